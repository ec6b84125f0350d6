"""Flattening and truncation of params; per-rank metric names (no server needed)."""

from hydraddp.tracking import names


def test_per_rank_metrics_and_aggregates():
    assert names.per_rank_metrics("memory/peak_bytes", [10, 30]) == {
        "memory/peak_bytes/rank0": 10.0, "memory/peak_bytes/rank1": 30.0, "memory/peak_bytes/max": 30.0,
        "memory/peak_bytes/min": 10.0, "memory/peak_bytes/mean": 20.0}


def test_long_values_are_truncated_with_a_marker():
    out = names.params({"model": {"layers": "x" * 10_000}, "a": 1})
    assert len(out["model.layers"]) == names.MAX_PARAM_LENGTH and out["model.layers"].endswith(names.TRUNCATED)
    assert out["a"] == "1"
