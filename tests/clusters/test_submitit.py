"""Slurm's path through Hydra's submitit launcher, run for real by submitit's local executor (`hydra/launcher=
submitit_local`, the same path on one machine): each task is one rank of the job's world (attached with submitit's own
TorchDistributedEnvironment). A sweep, a requeue and the preemption handler run on a real Slurm cluster instead:
scripts/slurm_test.sh (sweep, requeue)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from hydraddp.distributed.env import free_port
from tests.clusters.test_preemption import run_of
from tests.helpers.spawn import NO_MODEL, NO_PLAN, UNTRACKED, run_cli

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra: pip install 'hydraddp[slurm]'")

LOCAL = ["hydra/launcher=submitit_local", "launcher.nproc_per_node=2", NO_PLAN, NO_MODEL]


def free_master_port() -> dict[str, str]:
    """The environment of a launch whose tasks meet on a port free now. submitit's own choice is a port drawn from the
    job id in 20000-60000, most of Linux's ephemeral range: once, beside the other tests, rank 0 could not host its
    store there and rank 1's connections there went unanswered until launcher.timeout. submitit takes MASTER_PORT
    when it is set."""
    return {"MASTER_PORT": str(free_port())}


def sweep_jobs(root):
    return sorted(p.parent for p in root.glob("multirun/*/*/*/.hydra"))


def test_one_launch_through_submitit_is_one_job_of_two_tasks_and_one_finished_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    done = run_cli(*LOCAL, "trainer.max_steps=20", f"tracking.uri={uri}", cwd=tmp_path, timeout=240,
                   env=free_master_port())
    assert done.returncode == 0, done.stderr[-4000:]
    assert "hydraddp: done (submitit job). 20 steps at world size 2" in done.stdout
    [job] = sweep_jobs(tmp_path)
    assert sorted(p.name for p in (job / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert "spawn" not in (job / "logs" / "rank1.log").read_text().lower()
    [submitted] = list(job.parent.glob(".submitit/*/*_submitted.pkl"))  # one submitit job, its tasks the ranks
    assert sorted(p.name for p in submitted.parent.glob("*_result.pkl")) == [
        f"{submitted.name.split('_')[0]}_{task}_result.pkl" for task in (0, 1)]
    client, run = run_of(uri)
    assert run.info.status == "FINISHED" and run.data.tags["hydraddp.world_size"] == "2"


def test_a_rank_0_that_refuses_after_submission_ends_the_other_task_at_once(tmp_path):
    # As after a requeue on a cluster: only rank 0 checks the checkpoint it resumes, and finds it corrupt. The other
    # task, attached and waiting for rank 0 to form the group, is told, and ends long before launcher.timeout.
    from tests.clusters.test_refusal import corrupt_checkpoint

    timeout = 300
    checkpoint = corrupt_checkpoint(tmp_path / "elsewhere")
    started = time.monotonic()
    done = run_cli(*LOCAL, UNTRACKED, f"checkpoint.resume={checkpoint}", f"launcher.timeout={timeout}", cwd=tmp_path,
                   timeout=timeout, env=free_master_port())
    wall = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-3000:]  # rank 0's refusal is the job's outcome
    assert "the submitit job ended invalid" in done.stderr and "unreadable meta.json" in done.stderr
    assert "Traceback" not in done.stderr and "FailedJobError" not in done.stderr  # the report, not Hydra's error
    [rank1] = tmp_path.glob("multirun/*/*/.submitit/*/*_1_log.err")
    assert "rank 1 stopped before training: rank 0 refused to start" in rank1.read_text()
    assert wall < timeout / 2, wall
    # ... and for submitit (so for Slurm) the job failed, every task of it: not "completed successfully".
    from submitit.core.utils import FailedJobError, pickle_load
    from submitit.local.local import LocalJob

    [submitted] = tmp_path.glob("multirun/*/*/.submitit/*/*_submitted.pkl")
    job_id = submitted.name.split("_")[0]
    job = LocalJob(submitted.parent, job_id, tasks=(0, 1))
    assert isinstance(job.exception(), FailedJobError)
    for task, code in ((0, 2), (1, 1)):
        outcome, error = pickle_load(submitted.parent / f"{job_id}_{task}_result.pkl")
        assert outcome == "error" and f"rank {task}'s launch ended with exit {code}" in error, (task, error)
        assert "Job completed successfully" not in (submitted.parent / f"{job_id}_{task}_log.err").read_text()
    print(f"submitit refusal: the job ended after {wall:.1f} s (launcher.timeout={timeout}); exit {done.returncode}")


def test_a_failed_submitit_job_comes_back_as_an_outcome_and_the_jobs_after_it_are_still_waited_for(tmp_path,
                                                                                                  monkeypatch):
    """The plugin's launch() ends by gathering ``job.results()`` in order, and a failed job raises FailedJobError
    there. Wrapped (``every_job``), the failed job is a JobReturn holding a failed outcome, and the next job's result
    still comes back: the sweep's summary reports every job. Real submitit jobs, read from their result pickles."""
    import inspect

    from hydra.core.utils import JobReturn, JobStatus
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
    from submitit.core.utils import FailedJobError, cloudpickle_dump
    from submitit.local.local import LocalJob

    from hydraddp.clusters.submitit import every_job

    assert "[j.results()[0] for j in jobs]" in inspect.getsource(BaseSubmititLauncher.launch)  # what is wrapped
    ok = JobReturn(overrides=["wrap=ddp"], status=JobStatus.COMPLETED, _return_value={"status": "ok"})
    results = {"1": ("error", "hydraddp: rank 0's launch ended with exit 2: corrupt checkpoint"), "2": ("success", ok)}
    for job_id, result in results.items():
        for task in (0, 1):
            cloudpickle_dump(result, tmp_path / f"{job_id}_{task}_result.pkl")
    jobs = [LocalJob(tmp_path, job_id, tasks=(0, 1)) for job_id in results]

    def launch(jobs):  # as the plugin's launch() ends
        return [j.results()[0] for j in jobs]

    with pytest.raises(FailedJobError):
        launch(jobs)
    failed, done = every_job(launch)(jobs)
    assert failed.status == JobStatus.COMPLETED and failed.return_value["status"] == "failed"
    assert failed.return_value["error"] == "submitit job 1 failed: hydraddp: rank 0's launch ended with exit 2: " \
                                           "corrupt checkpoint"
    assert done.return_value == {"status": "ok"}
    with pytest.raises(FailedJobError):  # only for the wrapped call
        launch(jobs)
    # A job that left no result at all (its node lost, the job cancelled) is a failed job too, not Hydra's error.
    # (submitit gives a shared filesystem 15 s a task for a late result to appear: none will here)
    monkeypatch.setattr(LocalJob, "_results_timeout_s", 0.5)
    [lost] = every_job(launch)([LocalJob(tmp_path, "3", tasks=(0, 1))])
    assert lost.return_value["status"] == "failed"
    assert lost.return_value["error"] == "submitit job 3 failed: has not produced any output (state: NO PROCESS AND " \
                                         "NO RESULT)"


def test_a_tracking_file_with_a_launcher_for_other_machines_is_refused_before_submission(tmp_path):
    done = run_cli("hydra/launcher=submitit_slurm", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "nothing was submitted" in done.stderr and "tracking.uri=http://HOST:PORT" in done.stderr
    assert not list(tmp_path.glob("multirun/*/*/.submitit"))  # no job was submitted


def test_a_bad_config_through_submitit_exits_2_before_submission(tmp_path):
    done = run_cli(*LOCAL, "wrap=fsdp", "trainer.compile=true", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "trainer.compile=true cannot run with wrap=fsdp" in done.stderr
    assert not list(tmp_path.glob("multirun/*/*/.submitit"))


def test_the_slurm_preset_makes_the_sbatch_script_people_expect(tmp_path, monkeypatch):
    """No Slurm here: the preset goes through the plugin's parameter mapping (as its launch() does) into submitit's
    own Slurm executor, whose sbatch script is checked. submitit only looks for an srun on PATH; a stub stands in."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    from hydraddp.config.compose import compose

    (tmp_path / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    cfg = compose(["hydra/launcher=slurm", "launcher.nnodes=2", "launcher.nproc_per_node=4",
                   "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=4"], return_hydra_config=True)
    params = {k: v for k, v in OmegaConf.to_container(cfg.hydra.launcher, resolve=True).items()
              if k not in ("_target_", "submitit_folder")}
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path / "%j",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in shared else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit DIR", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--partition=gpu", "--signal=USR2@120",
                 "--time=240", "--job-name=hydraddp"):
        assert f"#SBATCH {line}\n" in script, line
    assert executor._executor.max_num_timeout == 3


def test_the_slurm_preset_runs_one_task_per_gpu_it_asks_for_under_nproc_per_node_auto():
    """launcher.nproc_per_node=auto (the default) on Slurm: the GPUs are on the nodes the job gets, not the machine
    that submits it, so auto is hydra.launcher.gpus_per_node tasks per node, and the CPU default without GPUs."""
    from hydraddp.config.compose import compose

    for given, tasks in ((["hydra.launcher.gpus_per_node=4"], 4), ([], 2), (["launcher.nproc_per_node=3"], 3)):
        cfg = compose(["hydra/launcher=slurm", *given], return_hydra_config=True)
        assert cfg.hydra.launcher.tasks_per_node == tasks, given
