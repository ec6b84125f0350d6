"""Flattening and truncation of params; per-rank metric names (no server needed)."""

from hydraddp.tracking import names


def test_per_rank_metrics_and_aggregates():
    assert names.per_rank_metrics("perf/step_time_s", [1, 3]) == {
        "perf/step_time_s/rank0": 1.0, "perf/step_time_s/rank1": 3.0, "perf/step_time_s/max": 3.0,
        "perf/step_time_s/min": 1.0, "perf/step_time_s/mean": 2.0}


def test_a_size_in_bytes_is_also_logged_in_mib_for_the_charts():
    mib = 2**20
    assert names.per_rank_metrics("memory/peak_bytes", [mib, 3 * mib]) == {
        "memory/peak_bytes/rank0": mib, "memory/peak_bytes/rank1": 3 * mib, "memory/peak_bytes/max": 3 * mib,
        "memory/peak_bytes/min": mib, "memory/peak_bytes/mean": 2 * mib,
        "memory/peak_mib/rank0": 1.0, "memory/peak_mib/rank1": 3.0, "memory/peak_mib/max": 3.0,
        "memory/peak_mib/min": 1.0, "memory/peak_mib/mean": 2.0}
    assert "sharding/param_mib/rank0" in names.sharding_metrics([{"local_numel": 4, "param_bytes": 16,
                                                                  "grad_bytes": 16, "optim_state_bytes": 32}])


def test_a_sweeps_job_is_named_by_what_the_sweep_varies():
    keys = names.swept_keys(["wrap=ddp,fsdp2", "precision=fp32,bf16", "trainer.max_steps=5",
                             "tracking.uri=http://h:5000", "+experiment@_global_=quick",
                             "optim.optimizer.lr=tag(log, interval(1e-5, 1e-1))"])
    assert keys == ["wrap", "precision", "optim.optimizer.lr"]
    job = ["wrap=fsdp2", "precision=bf16", "trainer.max_steps=5", "optim.optimizer.lr=0.001"]
    assert names.swept_label(job, keys) == "fsdp2-bf16-lr=0.001"
    assert names.swept_label(job, []) == ""
    assert names.run_name("{swept}", {"swept": "fsdp2-bf16"}) == "fsdp2-bf16"


def test_long_values_are_truncated_with_a_marker():
    out = names.params({"model": {"layers": "x" * 10_000}, "a": 1})
    assert len(out["model.layers"]) == names.MAX_PARAM_LENGTH and out["model.layers"].endswith(names.TRUNCATED)
    assert out["a"] == "1"
