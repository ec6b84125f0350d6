"""The plan against real 2-rank gloo runs: parameter, gradient and optimizer bytes exact, the peak of tensor memory
within 10% (torch's MemTracker over the second step, in the run and in the plan's simulated world), or, where the
plan says it is unsure, within the margin it states."""

from __future__ import annotations

import pytest

from hydraddp.config.compose import compose
from hydraddp.plan.estimate import estimate

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

STEPS = ["trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0", "tracking.enabled=false",
         "backend=gloo", "launcher.nproc_per_node=2"]
GPT = ["model=gpt", "data=text", "task=causal_lm", "model.depth=2", "data.batch_size=8"]
HF = ["model=hf_causal_lm", "data.batch_size=8"]
CASES = {
    "mlp-ddp-fp32": ["wrap=ddp", "precision=fp32"],
    "mlp-fsdp-bf16": ["wrap=fsdp", "precision=bf16"],
    "mlp-fsdp2-fp32": ["wrap=fsdp2", "precision=fp32"],
    "gpt-ddp-bf16": [*GPT, "wrap=ddp", "precision=bf16"],
    "gpt-fsdp-fp32": [*GPT, "wrap=fsdp", "precision=fp32"],
    "gpt-fsdp2-bf16": [*GPT, "wrap=fsdp2", "precision=bf16"],
    "gpt-fsdp2-fp32-checkpointed": [*GPT, "wrap=fsdp2", "precision=fp32", "trainer.activation_checkpointing=true"],
    "hf-ddp-fp32": [*HF, "wrap=ddp", "precision=fp32"],
    "hf-fsdp2-bf16": [*HF, "wrap=fsdp2", "precision=bf16"],
}


@pytest.fixture(scope="module")
def runs(pools):
    cases = {name: [*STEPS, *overrides] for name, overrides in CASES.items()}
    return pools.run("tests.plan.workers:measured", cases, timeout=600)


@pytest.fixture(scope="module")
def plans():
    return {name: estimate(compose([*STEPS, *overrides]), world_size=2, rank=0) for name, overrides in CASES.items()}


def held(planned, measured: int) -> bool:
    return abs(planned.peak_bytes - measured) <= 0.10 * measured


@pytest.mark.parametrize("name", CASES)
def test_the_plan_holds_the_measured_bytes_exactly_and_the_peak_to_ten_percent(runs, plans, name):
    planned = plans[name]
    report, peak = runs[0][name]["reports"][0], runs[0][name]["tensor_peaks"][0]
    assert (planned.param_bytes, planned.grad_bytes, planned.optim_state_bytes) == (
        report["param_bytes"], report["grad_bytes"], report["optim_state_bytes"]), name
    measured = peak["peak_bytes"]
    if not held(planned, measured):
        assert planned.unsure, (name, planned.peak_bytes, measured, peak["parts"])
        low, high = planned.peak_bytes, planned.peak_bytes + planned.peak_margin_bytes  # what the plan says
        assert 0.9 * low <= measured <= 1.1 * high, (name, low, high, measured)


def test_eight_of_nine_combinations_hold_to_ten_percent_as_the_readme_says(runs, plans):
    """The README's claim, word for word: 8 of 9 within 10%, and the one that is not is wrap=fsdp on gloo, which
    says it is unsure and by how much (held to that by the test above)."""
    within = {name: held(plans[name], runs[0][name]["tensor_peaks"][0]["peak_bytes"]) for name in CASES}
    assert sum(within.values()) >= 8, within
    assert all("fsdp-" in name and plans[name].unsure for name, ok in within.items() if not ok), within


# Pipeline stages (issue 56): 4 microbatches on 2 stages under 1F1B, so that the first stage holds 2 microbatches'
# activations at once and the last 1; each rank's plan is its own stage's.
PIPELINED = [*GPT, "wrap=fsdp2", "precision=fp32", "mesh.pp=2", "mesh.pp_microbatches=4"]


def test_the_plan_of_each_pipeline_stage_holds_its_ranks_bytes_exactly_and_its_peak_to_ten_percent(pools):
    [measured] = pools.run("tests.plan.workers:measured", {"pp": [*STEPS, *PIPELINED]}, timeout=600)[0].values()
    planned = [estimate(compose([*STEPS, *PIPELINED]), world_size=2, rank=rank) for rank in (0, 1)]
    for rank, plan in enumerate(planned):
        report, peak = measured["reports"][rank], measured["tensor_peaks"][rank]
        assert plan.units == [u for u in plan.units if u.name in report["units"]] and plan.units, (rank, report)
        assert (plan.param_bytes, plan.grad_bytes, plan.optim_state_bytes) == (
            report["param_bytes"], report["grad_bytes"], report["optim_state_bytes"]), rank
        assert held(plan, peak["peak_bytes"]), (rank, plan.peak_bytes, peak["peak_bytes"], peak["parts"])
    assert planned[0].activation_bytes > planned[1].activation_bytes  # 2 microbatches in flight against 1
