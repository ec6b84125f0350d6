"""A training step that logs nothing never makes the host wait for the GPU: 20 such steps of ``train()`` run under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronizing call (``.item()``, a blocking copy to
the host). Steps 1-2 (the report, the plan's measurement) and the last (logged) may synchronize."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.spawn import run_parallel

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
STEPS = 24


def steps_without_sync(local_rank: int, overrides: list[str]) -> int:
    """``train()`` with the sync check on from step 3's start to the last step's start; the steps checked."""
    from hydraddp.config.compose import compose
    from hydraddp.train import loop

    plain_step, checked = loop.train_step, []

    def checked_step(*args, **kwargs):
        step = len(checked) + 1
        checked.append(step)
        # "error" from step 3 on: everything up to the last step's start (the loop's bookkeeping between steps
        # included) runs under it; the last step logs, evaluates and reads its loss.
        torch.cuda.set_sync_debug_mode("error" if 3 <= step < STEPS else "default")
        return plain_step(*args, **kwargs)

    loop.train_step = checked_step
    try:
        loop.train(compose(overrides))
    finally:
        loop.train_step = plain_step
        torch.cuda.set_sync_debug_mode("default")
    return sum(1 for step in checked if 3 <= step < STEPS)


@pytest.mark.parametrize("wrap, nproc", [
    pytest.param("none", 1, id="one-gpu"),
    pytest.param("ddp", 2, id="ddp", marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")),
    pytest.param("fsdp2", 2, id="fsdp2", marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")),
])
def test_twenty_steps_that_log_nothing_never_synchronize_the_host(tmp_path, wrap, nproc):
    overrides = [f"wrap={wrap}", "backend=nccl" if nproc > 1 else "backend=none", f"trainer.max_steps={STEPS}",
                 "trainer.log_every=1000", "trainer.eval_every=0", "tracking.enabled=false", "plan.measure=false",
                 "checkpoint.preempt_check_every=5"]
    out = run_parallel("tests.gpu.test_host_sync:steps_without_sync", overrides, backend="nccl" if nproc > 1 else
                       "none", nproc=nproc, tmp_path=tmp_path, timeout=240)
    assert all(checked == STEPS - 3 for checked in out.values()), out
