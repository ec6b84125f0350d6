"""A run started from pretrained weights is a run like any other (issue 41): from a ``save_pretrained`` directory whose
sizes differ from the yaml's, stopped at step 4 and relaunched in the same job directory with
``checkpoint.resume=latest``, it ends where the uninterrupted run ends (every default on: plan, tracking, the logged
model, checkpoints); and its checkpoint exports in both formats from what the checkpoint recorded, even once the
pretrained directory is gone."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.spawn import job_dirs, run_cli, run_process
from tests.train.test_pretrained import SIZES, SMALL_DATA, save_llama

pytestmark = pytest.mark.slow  # launches for real

STEPS = 8


def launch(tmp_path: Path, where: str, wrap: str, weights: Path, *extra: str):
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = run_cli("model=hf_causal_lm", f"model.pretrained={weights}", f"wrap={wrap}", "backend=gloo",
                   "launcher.nproc_per_node=2", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
                   "trainer.eval_every=0", "checkpoint.every_n_steps=2", "checkpoint.save_last=true", *SMALL_DATA,
                   f"tracking.uri={db}", f"tracking.experiment={where}", f"hydra.run.dir={tmp_path / where}", *extra,
                   cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return tmp_path / where


def final_loss(tmp_path: Path, experiment: str) -> tuple[float, list[int]]:
    """The last step's train/loss of the experiment's one run, and the steps it logged."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    return [m.value for m in history if m.step == STEPS][0], sorted(m.step for m in history)


def export(checkpoint: Path, out: Path, *fmt: str) -> Path:
    done = run_process([sys.executable, "-m", "hydraddp.export", str(checkpoint), str(out), *fmt], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# Sharded weights: their load and their resharded save are what a pretrained resume could get wrong. The pretrained x
# stop-and-resume pair under the other wraps and backends is tests/train/test_pairwise.py's.
@pytest.mark.parametrize("wrap", ["fsdp2"])
def test_a_pretrained_run_stopped_and_resumed_ends_where_the_uninterrupted_one_does(tmp_path, wrap):
    import transformers

    weights = save_llama(tmp_path / "llama")  # hidden 32, 3 layers, rope_theta 5000: not hf_causal_lm.yaml's
    full = launch(tmp_path, "full", wrap, weights)
    stopped = launch(tmp_path, "stopped", wrap, weights, "trainer.stop_at_step=4")
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir())[-1] == "step_00000004"
    launch(tmp_path, "stopped", wrap, weights, "checkpoint.resume=latest")  # before issue 41: exit 2, "not a checkpoint"

    expected, full_steps = final_loss(tmp_path, "full")
    resumed, resumed_steps = final_loss(tmp_path, "stopped")
    assert resumed_steps == full_steps == list(range(1, STEPS + 1))  # one run, every step once
    assert abs(resumed - expected) <= 1e-5, (resumed, expected)

    # The exports read what the checkpoint recorded (its transformers config), not the pretrained directory.
    shutil.move(weights, tmp_path / "moved")
    final = f"checkpoints/step_{STEPS:08d}"
    reference = torch.load(export(full / final, tmp_path / "full.pt"), weights_only=True)
    continued = torch.load(export(stopped / final, tmp_path / "resumed.pt"), weights_only=True)
    assert reference.keys() == continued.keys()
    assert max((reference[k] - continued[k]).abs().max().item() for k in reference) <= 1e-5
    assert continued["model.layers.2.mlp.up_proj.weight"].shape == (SIZES["intermediate_size"], SIZES["hidden_size"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(export(stopped / final, tmp_path / "hf", "--format", "hf"))
    assert hf.config.rope_parameters["rope_theta"] == SIZES["rope_theta"] and hf.config.num_hidden_layers == 3
    loaded = hf.state_dict()
    assert [k for k in continued if not torch.equal(loaded[k], continued[k])] == []
    assert job_dirs(tmp_path) == []  # every launch went into its hydra.run.dir
