"""A later launch never damages a run it continues: failing before its first step leaves the run as it was,
and a resume into another wrap or world size says so in the run (``hydraddp.resumed_from``)."""

import json

import pytest

from tests.helpers.spawn import NO_MODEL, NO_PLAN, job_dirs, run_cli

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

BASE = ["trainer.log_every=1", "trainer.eval_every=0", "trainer.max_steps=12", "checkpoint.every_n_steps=5", NO_PLAN]


def client_and_run(db):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    return client, run


def test_failed_launches_leave_the_run_they_meant_to_continue_as_it_was(tmp_path):
    db = tmp_path / "mlflow.db"
    tracking = [f"tracking.uri=sqlite:///{db}", NO_MODEL]
    first = run_cli("wrap=ddp", *BASE, *tracking, cwd=tmp_path / "first")
    assert first.returncode == 0, first.stderr[-3000:]
    [job] = job_dirs(tmp_path / "first")
    client, before = client_and_run(db)
    assert before.info.status == "FINISHED"

    # A checkpoint of another model: refused before anything starts (the run is not even opened).
    other = run_cli("model=gpt", "data=text", *BASE, *tracking,
                    f"checkpoint.resume={job / 'checkpoints' / 'step_00000010'}", cwd=tmp_path / "other")
    assert other.returncode == 2 and "is not a checkpoint of this model" in other.stderr
    # A continuation whose workers fail before their first step.
    broken = run_cli(*BASE, *tracking, "optim.optimizer.lr=-1", f"tracking.run_id={before.info.run_id}",
                     cwd=tmp_path / "broken")
    assert broken.returncode == 1
    assert f"before its first step; MLflow run {before.info.run_id} keeps its status FINISHED" in broken.stdout

    _, after = client_and_run(db)
    assert after.info.status == "FINISHED" and after.info.end_time == before.info.end_time
    assert after.data.tags == before.data.tags and after.data.params == before.data.params
    assert "error.txt" not in {a.path for a in client.list_artifacts(after.info.run_id)}


def test_a_resume_into_another_wrap_and_world_size_is_visible_in_the_run(tmp_path):
    db = tmp_path / "mlflow.db"
    tracking = [f"tracking.uri=sqlite:///{db}", NO_MODEL]
    stopped = run_cli("wrap=ddp", *BASE, "trainer.stop_at_step=10", *tracking, cwd=tmp_path / "stopped")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    [job] = job_dirs(tmp_path / "stopped")
    checkpoint = job / "checkpoints" / "step_00000010"
    resumed = run_cli("wrap=fsdp2", "backend=gloo", "launcher.nproc_per_node=1", *BASE, *tracking,
                      f"checkpoint.resume={checkpoint}", cwd=tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client, run = client_and_run(db)  # still one run: the resume continued it
    tags = run.data.tags
    assert (tags["hydraddp.wrap"], tags["hydraddp.world_size"]) == ("fsdp2", "1")  # what it runs with now
    [earlier] = json.loads(tags["hydraddp.resumed_from"])  # and what it ran with until the resume
    assert earlier == {"checkpoint": str(checkpoint.resolve()), "step": 10, "backend": "gloo", "wrap": "ddp",
                       "precision": "fp32", "offload": "none", "world_size": "2"}
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert steps == list(range(1, 13))
