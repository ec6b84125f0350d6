"""Rank side of the plan tests: train a composed config for a few steps, and return what the plan predicts."""

from __future__ import annotations


def measured(local_rank: int, cases: dict[str, list[str]]) -> dict:
    """For each config (name -> overrides): this rank's WrapReport after the first step and the tensor peak of the
    second, as ``train()`` measures them."""
    from hydraddp.config.compose import compose
    from hydraddp.train.loop import train

    out = {}
    for name, overrides in cases.items():
        result = train(compose(overrides))
        out[name] = {"reports": result.reports, "tensor_peaks": result.tensor_peaks}
    return out
