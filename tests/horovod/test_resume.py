"""backend=horovod stopped at step 5 and relaunched in the same job directory (``checkpoint.resume=latest``) ends
where the uninterrupted run ends: the same losses after the resume point and the same final weights.

Only a launch shows it: the relaunch builds a fresh Horovod ``DistributedOptimizer`` whose state
torch.distributed.checkpoint fills, and DCP's ``_init_optim_state`` calls ``zero_grad(set_to_none=True)``, which
Horovod 0.28.1's ``zero_grad(self)`` refused with a TypeError on every rank."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.horovod import HOROVOD_TESTS
from tests.helpers.spawn import NO_PLAN, UNTRACKED, job_dirs, run_cli

pytestmark = HOROVOD_TESTS

STEPS, STOP = 7, 5
COMMON = ["backend=horovod", "launcher.nproc_per_node=2", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
          "trainer.eval_every=0", "checkpoint.save_last=true", NO_PLAN, UNTRACKED]
# The default MLP in fp32 (AdamW: its state must come back); a one-layer Hugging Face llama in mixed bf16 with two
# accumulated batches (Horovod reduces after the second backward). bf16 compares within its own rounding (8 bits
# of mantissa), as the pairwise matrix's bf16 resumes do.
CASES = {
    "mlp-fp32": ([], 1e-6),
    "hf-bf16-accumulate": (["model=hf_causal_lm", "model.num_hidden_layers=1", "precision=bf16",
                            "trainer.accumulate_grad_batches=2", "data.seq_len=16", "data.batch_size=8",
                            "data.dataset.num_chars=4000"], 2e-3),
}


def launch(tmp_path: Path, where: str, *overrides: str) -> dict[int, float]:
    """One launch in ``tmp_path/where`` (its job directory): the losses it logged, by step."""
    done = run_cli(*COMMON, *overrides, f"hydra.run.dir={tmp_path / where}", cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / where / "result.json").read_text())
    return {int(step): loss for step, loss in result["losses"].items()}


def final_weights(job: Path) -> dict[str, torch.Tensor]:
    from hydraddp.train.formats import export

    return torch.load(export(job / "checkpoints" / f"step_{STEPS:08d}", job / "final.pt"), weights_only=True)


@pytest.mark.parametrize("case", CASES)
def test_a_stopped_horovod_run_resumes_where_the_uninterrupted_one_goes_on(tmp_path, case):
    overrides, tolerance = CASES[case]
    whole = launch(tmp_path, "whole", *overrides)
    stopped = launch(tmp_path, "stopped", *overrides, f"trainer.stop_at_step={STOP}")
    assert sorted(stopped) == list(range(1, STOP + 1))
    resumed = launch(tmp_path, "stopped", *overrides, "checkpoint.resume=latest")  # the same job directory
    assert sorted(resumed) == list(range(STOP + 1, STEPS + 1))  # it went on from the stop, not from the start
    for step in range(1, STEPS + 1):
        done = stopped[step] if step <= STOP else resumed[step]
        assert math.isclose(done, whole[step], rel_tol=tolerance, abs_tol=tolerance), (step, done, whole[step])
    reference, continued = final_weights(tmp_path / "whole"), final_weights(tmp_path / "stopped")
    assert reference.keys() == continued.keys()
    worst = max((reference[k].float() - continued[k].float()).abs().max().item() for k in reference)
    assert worst <= tolerance, worst
    assert job_dirs(tmp_path) == []  # every launch went into its hydra.run.dir
