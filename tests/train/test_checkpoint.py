"""Checkpoints, resume and fault tolerance with 2 real gloo ranks: a stopped and resumed run ends where an
uninterrupted one does, checkpoints move between wrap modes and world sizes, a SIGKILLed worker is restarted
by torch's agent and loses nothing, and nothing half-written or foreign is ever loaded."""

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers.spawn import (NO_MODEL, NO_PLAN, UNTRACKED, assert_no_orphans, child_env, job_dirs, run_cli,
                                 run_process, sigkill_rank_when_logged, wait_for_published_checkpoint)

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md
# Every claimed Python runs the tests marked so (scripts/pythons.sh): a stop and resume, the reshards, the export and
# the refusals. What a checkpoint index holds depends on the Python that pickled it; how a killed process leaves its
# checkpoint does not.
every_python = pytest.mark.every_python

BASE = ["optim=sgd", "trainer.log_every=1", "trainer.eval_every=0", "checkpoint.every_n_steps=5", NO_PLAN]


def export(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    done = run_process([sys.executable, "-m", "hydraddp.export", str(checkpoint), str(out)], cwd=out.parent, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr  # one process reading a checkpoint is nothing to warn about
    return torch.load(out, weights_only=True)  # a plain state_dict: no pickled objects


def checkpoints(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def losses(job: Path, rank: int = 0) -> dict[int, float]:
    text = (job / "logs" / f"rank{rank}.log").read_text()
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) loss ([\d.]+)", text)}


DATA = {"dropout": ["model=gpt", "data=text", "model.depth=1", "model.dim=32", "model.heads=2", "model.dropout=0.2",
                    "data.seq_len=16", "data.batch_size=8"],  # dropout draws from the rank's own RNG at every step
        # noise drawn in the loader's workers (two per rank), and a stream (an IterableDataset, no length): user data
        "augmented": ["data.dataset._target_=tests.train.user_data.noisy_digits", "~data.dataset.eval_fraction",
                      "~data.dataset.seed", "data.num_workers=4"],
        "stream": ["data.dataset._target_=tests.train.user_data.digit_stream", "~data.dataset.eval_fraction",
                   "~data.dataset.seed", "data.num_workers=2"]}


@pytest.mark.parametrize("wrap,data", [("ddp", "augmented"), ("fsdp", "stream"),
                                       pytest.param("fsdp2", "dropout", marks=every_python)])
def test_stop_and_resume_ends_where_an_uninterrupted_run_does(tmp_path, wrap, data):
    """Each wrap with other data or model (the loader's and the RNGs' state are the same code under every wrap), each
    launch three times. A dropout GPT draws at every step: the ranks' RNGs are restored right before the first step,
    after the loader made its iterator (which once drew from the same RNG). (This absorbed the dropout test of ddp and
    fsdp2: the RNG restore does not depend on the wrap.)
    The training loader's state is in the checkpoint (torchdata's StatefulDataLoader): its position and each loader
    worker's RNGs, so the noise drawn in workers is drawn again as the uninterrupted run drew it (torch seeds a worker
    once, at the epoch's start: it once drew the epoch's first noise again), and a stream dealt over ranks and
    workers skips what it gave. With the digits, 30 steps cross an epoch (23 steps) after the resume at 10."""
    mlflow = [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", NO_MODEL]
    common = [f"wrap={wrap}", *BASE, "trainer.max_steps=30", *DATA[data]]
    full = run_cli(*common, "checkpoint.save_last=true", UNTRACKED, cwd=tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    stopped = run_cli(*common, "trainer.stop_at_step=12", *mlflow, cwd=tmp_path / "stopped")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    [stopped_job] = job_dirs(tmp_path / "stopped")
    assert checkpoints(stopped_job / "checkpoints") == ["step_00000010", "step_00000012"]  # keep_last=2
    resumed = run_cli(*common, "checkpoint.save_last=true",
                      f"checkpoint.resume={stopped_job / 'checkpoints' / 'step_00000010'}", *mlflow,
                      cwd=tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [full_job], [resumed_job] = job_dirs(tmp_path / "full"), job_dirs(tmp_path / "resumed")
    assert min(losses(resumed_job)) == 11  # it went on from step 10, not from the start
    assert [losses(resumed_job)[s] for s in range(11, 31)] == [losses(full_job)[s] for s in range(11, 31)]
    reference = export(full_job / "checkpoints" / "step_00000030", tmp_path / "full.pt")
    continued = export(resumed_job / "checkpoints" / "step_00000030", tmp_path / "resumed.pt")
    assert max_diff(reference, continued) <= 1e-6

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow[0].split("=", 1)[1])
    runs = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    [stopped_run] = runs  # the stopped run, which the resume continued (the uninterrupted one is untracked)
    assert stopped_run.info.run_id == _run_id(resumed_job) == _run_id(stopped_job)
    steps = [m.step for m in client.get_metric_history(stopped_run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 31))  # every step exactly once, though 11 and 12 ran twice


def _run_id(job: Path) -> str:
    return (job / "mlflow_run_id").read_text().strip()


RESHARDING = [("fsdp2", 2, "ddp", 1), ("ddp", 2, "fsdp", 2), ("fsdp", 2, "fsdp2", 1)]


@every_python
@pytest.mark.parametrize("source_wrap, source_world, target_wrap, target_world", RESHARDING,
                         ids=[f"{a}@{b}->{c}@{d}" for a, b, c, d in RESHARDING])
def test_a_checkpoint_loads_into_another_wrap_and_world_size(tmp_path, source_wrap, source_world, target_wrap,
                                                              target_world):
    def launch(wrap, world, *extra, where):
        backend = [] if world > 1 else ["backend=gloo"]
        done = run_cli(f"wrap={wrap}", f"launcher.nproc_per_node={world}", *backend, *BASE, "trainer.max_steps=11",
                       UNTRACKED, *extra, cwd=tmp_path / where)
        assert done.returncode == 0, done.stderr[-3000:]
        return job_dirs(tmp_path / where)[0]

    source = launch(source_wrap, source_world, where="source")
    target = launch(target_wrap, target_world, f"checkpoint.resume={source / 'checkpoints' / 'step_00000010'}",
                    where="target")
    # The step after the checkpoint computes the loss the source run computed there.
    assert losses(target)[11] == pytest.approx(losses(source)[11], abs=1e-5)
    assert f"auto_model: wrap={target_wrap}" in (target / "logs" / "rank0.log").read_text()


def test_a_sigkilled_worker_is_restarted_and_the_job_finishes_as_if_nothing_happened(tmp_path):
    config = [*BASE, "trainer.max_steps=200", "checkpoint.every_n_steps=20", "checkpoint.save_last=true",
              "model.hidden=[512,512]"]
    full = run_cli(*config, UNTRACKED, cwd=tmp_path / "full", timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]

    killed = tmp_path / "killed"
    killed.mkdir()
    token = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "hydraddp", *config, "launcher.max_restarts=1"], cwd=killed,
                            env=child_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_published_checkpoint(proc, killed, 20)
        sigkill_rank_when_logged(proc, killed, r"step (2[1-9]|[3-9]\d) loss")
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert_no_orphans(token)
    [job], [full_job] = job_dirs(killed), job_dirs(tmp_path / "full")
    assert "restarted from" in (job / "logs" / "rank0.log").read_text()
    reference = export(full_job / "checkpoints" / "step_00000200", tmp_path / "full.pt")
    recovered = export(job / "checkpoints" / "step_00000200", tmp_path / "recovered.pt")
    assert max_diff(reference, recovered) <= 1e-6

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{killed / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["hydraddp.restarts"] == "1"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 201))  # the steps replayed after the restart are not logged twice


@pytest.mark.parametrize("worker", ["killed_during_save", "killed_during_background_save"])
def test_a_process_killed_during_a_save_leaves_latest_on_the_previous_checkpoint(tmp_path, worker):
    from hydraddp.handoff.checkpoints import complete_checkpoints, find
    from tests.helpers.spawn import run_parallel

    root = tmp_path / "checkpoints"
    failure = run_parallel(f"tests.train.workers:{worker}", str(root), tmp_path=tmp_path, expect_failure=True)
    assert "SIGKILL" in failure["message"] or failure["exitcode"] != 0
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010", "step_00000020.tmp"]
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000010"]
    assert find(root, "latest").name == "step_00000010"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    where = tmp_path_factory.mktemp("saved")
    done = run_cli("wrap=fsdp2", *BASE, "trainer.max_steps=5", UNTRACKED, cwd=where)
    assert done.returncode == 0, done.stderr[-3000:]
    return job_dirs(where)[0] / "checkpoints" / "step_00000005"


@every_python
def test_the_export_loads_with_weights_only_into_the_unwrapped_model(saved, tmp_path):
    from hydraddp.models.mlp import MLP

    state = export(saved, tmp_path / "model.pt")
    model = MLP()
    model.load_state_dict(state)  # strict: every key, every shape
    assert all(isinstance(v, torch.Tensor) for v in state.values())


@every_python
def test_a_checkpoint_of_another_model_is_refused_before_anything_starts(saved, tmp_path):
    done = run_cli("model=gpt", "data=text", *BASE, "trainer.max_steps=6", UNTRACKED,
                   f"checkpoint.resume={saved}", cwd=tmp_path)
    assert done.returncode == 2  # checked on the meta device in the launching process: no worker started
    assert "is not a checkpoint of this model: missing ['model.blocks.0.attn.proj.bias'" in done.stderr
    assert "[rank" not in done.stderr and job_dirs(tmp_path) == []


@every_python
def test_a_corrupt_checkpoint_is_refused_before_anything_starts(saved, tmp_path):
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(saved, corrupt)
    (corrupt / ".metadata").write_bytes(b"not a checkpoint index")
    done = run_cli(*BASE, "trainer.max_steps=6", UNTRACKED, f"checkpoint.resume={corrupt}", cwd=tmp_path)
    assert done.returncode == 2
    assert f"{corrupt}: corrupt or incomplete DCP checkpoint" in done.stderr and "Traceback" not in done.stderr
    missing = run_cli(*BASE, UNTRACKED, f"checkpoint.resume={tmp_path / 'nowhere'}", cwd=tmp_path)
    assert missing.returncode == 2 and "not a complete hydraddp checkpoint" in missing.stderr
    exported = run_process([sys.executable, "-m", "hydraddp.export", str(tmp_path / "nowhere"), str(tmp_path / "m.pt")],
                           cwd=tmp_path, timeout=60)
    assert exported.returncode == 2 and f"{tmp_path / 'nowhere'}: no such checkpoint" in exported.stderr
