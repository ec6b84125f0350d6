"""Preemption: a stop signal makes every rank checkpoint the same step and stop; the next launch in that job
directory resumes into the same MLflow run, and the result equals an uninterrupted run's."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.spawn import NO_MODEL, NO_PLAN, interrupt_when, job_dirs, run_cli, run_process

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

STEPS = ["trainer.max_steps=200", "trainer.log_every=10", "trainer.eval_every=0", "checkpoint.save_last=true", NO_PLAN,
         NO_MODEL]


def logged(pattern: str, glob: str, root):
    def ready() -> bool:
        logs = sorted(root.glob(glob))
        return len(logs) == 2 and bool(re.search(pattern, logs[0].read_text()))
    return ready


def final_params(job) -> dict[str, torch.Tensor]:
    [last] = sorted((job / "checkpoints").glob("step_00000200"))
    out = job / "model.pt"
    done = run_process([sys.executable, "-m", "hydraddp.export", str(last), str(out)], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def run_of(uri: str):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    return client, run


def signal_every_process(signum: int):
    """Send ``signum`` to every process of the launch (its session: the launcher, its ranks, the MLflow tracker in
    a process group of its own), as Slurm signals every process of a job before its time limit."""
    def send(proc) -> None:
        for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()):
            with contextlib.suppress(OSError):
                if os.getsid(pid) == proc.pid:
                    os.kill(pid, signum)
    return send


def test_sigusr2_to_every_process_of_a_local_launch_checkpoints_every_rank_at_one_step_and_exits_3_then_resumes(
        tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    done = interrupt_when([sys.executable, "-m", "hydraddp", *STEPS, f"tracking.uri={uri}"],
                          ready=logged(r"step 50 loss", "outputs/*/*/logs/rank*.log", tmp_path), cwd=tmp_path,
                          send=signal_every_process(signal.SIGUSR2))
    assert done.returncode == 3, done.stderr[-3000:]
    [job] = job_dirs(tmp_path)
    [marker] = json.loads((job / "preempted.json").read_text())
    step = marker["step"]
    assert 50 <= step < 200 and marker["signal"] == "SIGUSR2"
    checkpoint = job / "checkpoints" / f"step_{step:08d}"
    assert marker["checkpoint"] == str(checkpoint) and (checkpoint / "meta.json").exists()
    assert sorted(p.name for p in checkpoint.glob("rng_rank*.json")) == ["rng_rank0.json", "rng_rank1.json"]
    assert f"stopped by SIGUSR2 after step {step}" in done.stderr and f"hydra.run.dir={job}" in done.stderr
    client, run = run_of(uri)  # the tracker outlived the signal (it once died of it, and the run stayed RUNNING)
    assert run.info.status == "KILLED" and json.loads(run.data.tags["hydraddp.preempted"])["step"] == step

    resumed = run_cli(*STEPS, f"tracking.uri={uri}", f"hydra.run.dir={job}", cwd=tmp_path, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client, run = run_of(uri)
    assert run.info.status == "FINISHED" and run.data.tags["hydraddp.requeued"] == "1"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 200 and step in steps  # every logged step once

    uninterrupted = run_cli(*STEPS, "tracking.enabled=false", cwd=tmp_path / "plain", timeout=240)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    [plain] = job_dirs(tmp_path / "plain")
    expected, got = final_params(plain), final_params(job)
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) < 1e-6


def test_under_torchrun_sigterm_gives_the_same_checkpoint_and_every_rank_resumes_from_it(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "hydraddp"]
    done = interrupt_when([*torchrun, *STEPS, f"tracking.uri={uri}"],
                          ready=logged(r"step 50 loss", "outputs/*/*/logs/rank*.log", tmp_path), cwd=tmp_path,
                          send=lambda proc: proc.send_signal(signal.SIGTERM))
    assert done.returncode != 0  # torchrun reports the signal itself; its ranks exited 3 after the checkpoint
    [job] = job_dirs(tmp_path)
    [marker] = json.loads((job / "preempted.json").read_text())
    assert (job / "checkpoints" / f"step_{marker['step']:08d}" / "meta.json").exists()
    assert run_of(uri)[1].info.status == "KILLED"
    # Rank 1 composes into "." under torchrun: it finds the marker in the job directory the ranks agree on.
    resumed = run_process([*torchrun, *STEPS, f"tracking.uri={uri}", f"hydra.run.dir={job}"], cwd=tmp_path,
                          timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in (0, 1):
        assert f"resumed from {marker['checkpoint']} at step {marker['step']}" in (job / "logs" / f"rank{rank}.log"
                                                                                   ).read_text()
    client, run = run_of(uri)
    assert run.info.status == "FINISHED" and run.data.tags["hydraddp.requeued"] == "1"
