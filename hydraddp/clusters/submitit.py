"""Inside a job that Hydra's submitit launcher started (``hydra/launcher=submitit_slurm``, ``submitit_local``).

Each submitit task is one rank of the job's world: it attaches to it with submitit's own
``TorchDistributedEnvironment`` (no second launcher inside the task). On preemption, after every rank checkpointed
the same step, rank 0 hands over to submitit's own handler, which pickles the job again and requeues it
(``scontrol requeue`` on Slurm, the local controller's requeue code locally); the requeued job resumes from the
job directory's preemption marker (``hydraddp.train.preemption``).

A task whose launch was refused or failed fails for submitit and Slurm too (``fail``), and the submitting command
still waits for every job and reports each from its ``outcome.json`` (``wait_for_every_job``).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from typing import Any, Callable, NoReturn

# The hydra/launcher options that run jobs through submitit: the plugin's two and hydraddp's preset.
LAUNCHERS = ("submitit_local", "submitit_slurm", "slurm")
# Launchers whose jobs may run on other machines than the submitting one (a sqlite tracking file cannot follow).
REMOTE_LAUNCHERS = ("submitit_slurm", "slurm")


SINGLE_JOB_ENV = "HYDRADDP_SUBMITIT_SINGLE_JOB"  # set when one launch (no -m) goes through submitit


def launcher_choice(argv: list[str]) -> str | None:
    """The ``hydra/launcher=NAME`` option on the command line, if any."""
    found = [m.group(1) for a in argv if (m := re.fullmatch(r"hydra/launcher=(\S+)", a))]
    return found[-1] if found else None


def prepare_argv(argv: list[str]) -> list[str]:
    """``argv`` (``sys.argv``: the program first) for a submitit launcher, which runs as Hydra's multirun: one launch without ``-m`` becomes a sweep of one job (and is
    reported as a single launch). The job gets ``launcher.nnodes`` nodes of ``launcher.nproc_per_node`` tasks,
    unless ``hydra.launcher.nodes`` / ``tasks_per_node`` are given."""
    if launcher_choice(argv) not in LAUNCHERS:
        return argv
    # nproc_per_node=auto: one task per GPU the job asks for (config.schema.tasks_per_node). Quoted: Hydra's override
    # grammar takes a resolver's nested interpolations only inside quotes.
    tasks = "'${hydraddp.tasks_per_node:${launcher.nproc_per_node},${hydra.launcher.gpus_per_node}}'"
    values = {"tasks_per_node": tasks, "nodes": "${launcher.nnodes}"}
    extra = [f"hydra.launcher.{key}={value}" for key, value in values.items()
             if not any(a.startswith(f"hydra.launcher.{key}=") for a in argv)]
    if not {"-m", "--multirun"} & set(argv):
        os.environ[SINGLE_JOB_ENV] = "1"
        return [argv[0], "--multirun", *argv[1:], *extra]  # the flag before the overrides (argparse)
    return [*argv, *extra]


def in_task() -> bool:
    """True in a process that submitit started as a task of a job."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR")) and "SUBMITIT_FOLDER" in os.environ


def attach() -> None:
    """Export the job's world as torch's env:// variables (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE), from submitit's own job environment. CUDA_VISIBLE_DEVICES is left alone: hydraddp picks the
    device by local rank."""
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


# How long the other ranks of a Slurm job wait for rank 0's requeue to stop them (``requeue``).
REQUEUE_WAIT_S = 30.0


def requeue(rank: int, exit_code: int, stop_signal: str) -> str:
    """After a preemption checkpoint: rank 0 asks submitit to requeue the job (its handler exits this process), and
    returns only when submitit will not (a job that timed out ``max_num_timeout`` times): why, for the launch's
    outcome, which then ends as a preempted launch (its checkpoint resumes). The other ranks wait for the requeue to
    stop them: a task that ended first, non-zero, could end the job FAILED before rank 0's `scontrol requeue` (seen on
    a real Slurm: the submitting side then read the job FAILED and raised). submitit's own handler leaves them running
    for the same reason ("it might kill the master task"). On Slurm a rank still running after ``REQUEUE_WAIT_S`` was
    not requeued: it leaves a result, as a task that returned does, then exits with ``exit_code`` (the job FAILED for
    Slurm: it did not finish its training). Exiting without a result made the submitting side wait for that task's
    until Slurm's time limit and submitit's polling ended it (minutes, on a real Slurm).

    Slurm's own SIGTERM (an outside `scontrol requeue`, a preemption, `scancel`, the end of the time limit) is not
    answered with a requeue: Slurm is ending this attempt itself, and requeues the job when it is to come back. Asking
    again raced it on a real Slurm ("Job is pending execution"), and the error, returned as the task's result, made
    the submitting side report a failure while the job's next attempt trained on. The attempt ends as submitit's own
    requeue ends it, with no result."""
    if rank == 0:
        if stop_signal == "SIGTERM" and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
            _end_attempt("Slurm stopped the job (SIGTERM); it requeues the job itself if the job is to come back")
        import signal

        from submitit import JobEnvironment
        from submitit.core.utils import UncompletedJobError

        signum = JobEnvironment._usr_sig()
        handler = signal.getsignal(signum)  # submitit's checkpoint_and_try_requeue, restored after training
        if callable(handler):
            try:
                handler(signum, None)  # requeues, then exits
            except UncompletedJobError as exc:  # "Job not requeued because: timed-out too many times."
                return str(exc)
            except subprocess.CalledProcessError as exc:  # its `scontrol requeue` was refused
                return _requeue_refused(exc)
    elif os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        import time

        time.sleep(REQUEUE_WAIT_S)  # the requeue's SIGKILL ends it first (submitit ignores its SIGTERM)
        _save_result("success", f"hydraddp: rank {rank} was preempted, and not requeued")
    sys.exit(exit_code)


def _end_attempt(why: str) -> NoReturn:
    """End this attempt of the job as submitit's requeue ends it: no result for the submitting side to read."""
    print(f"hydraddp: {why}: this attempt ends, and the next one resumes from its checkpoint", file=sys.stderr,
          flush=True)
    sys.exit(-1)


def _requeue_refused(exc: Exception) -> str:
    """Slurm refused rank 0's `scontrol requeue` (after a USR signal). When the job is already on its way back or out
    (Slurm requeued or is ending it), this attempt ends with no result; otherwise (requeues disabled) the launch ends
    preempted, saying why, and its checkpoint resumes."""
    job = os.environ.get("SLURM_JOB_ID", "")
    state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                           check=False).stdout.strip()
    if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "COMPLETING"):
        _end_attempt(f"Slurm refused the requeue of job {job}, which is {state}")
    return f"Job not requeued: `scontrol requeue` failed ({exc}) and the job is {state or 'gone'}"


def fail(rank: int, exit_code: int, reason: str) -> NoReturn:
    """This task's launch ended with ``exit_code`` (2 invalid, 1 a worker failed): record it as submitit records a
    function that raised, an ``("error", ...)`` result pickle (the submitting side's ``job.results()`` raises
    ``FailedJobError``, ``job.exception()`` returns it), then exit with ``exit_code``: a task that exits non-zero
    makes Slurm's job state FAILED, not COMPLETED.

    Raising from the task function cannot do it: Hydra's ``run_job`` catches the function's exceptions and returns
    them in a ``JobReturn``, which submitit then pickles as a success. (A preempted task is not failed: submitit
    requeues it, ``requeue``.)"""
    from submitit.core.logger import get_logger

    _save_result("error", f"hydraddp: rank {rank}'s launch ended with exit {exit_code}: {reason}")
    get_logger().error(f"Job failed: exit {exit_code} (see above)")  # in the task's log, where submitit logs its own
    sys.exit(exit_code)


def _save_result(outcome: str, value: Any) -> None:
    """This task's result, as submitit writes it (``outcome``: "success" or "error"), for the submitting side."""
    from submitit import JobEnvironment
    from submitit.core import utils

    with utils.temporary_save_path(JobEnvironment().paths.result_pickle) as tmppath:
        utils.cloudpickle_dump((outcome, value), tmppath)


def every_job(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``launch`` (the plugin's ``BaseSubmititLauncher.launch``), for the submitting command: it gathers its jobs'
    results with ``job.results()``, and the first failed job's ``FailedJobError`` would end it, the jobs after it
    not waited for and the sweep ended by Hydra's traceback, before any summary. Here every job is waited for, and a
    failed one comes back as a JobReturn like the others (COMPLETED: Hydra's sweeper raises a FAILED one's value),
    holding ``{"status": "failed", ...}``; how each job ended is in its ``outcome.json``, which the summary and the
    single launch's report read (``hydraddp.sweep``). So does a job that produced no result at all
    (``UncompletedJobError``: its node lost, the job cancelled), which once ended the command as Hydra's error, exit 2
    ("invalid configuration") for what was a failed job."""

    @functools.wraps(launch)
    def launch_every_job(*args: Any, **kwargs: Any) -> Any:
        from submitit.core.core import Job
        from submitit.core.utils import FailedJobError, UncompletedJobError

        results = Job.results

        def results_or_failure(job: Any) -> list:
            try:
                return results(job)
            except (FailedJobError, UncompletedJobError) as exc:
                return [_failed_return(job, exc)]

        Job.results = results_or_failure  # type: ignore[method-assign]  # for this call only
        try:
            return launch(*args, **kwargs)
        finally:
            Job.results = results  # type: ignore[method-assign]

    launch_every_job.hydraddp_every_job = True  # type: ignore[attr-defined]
    return launch_every_job


def _failed_return(job: Any, exc: Exception) -> Any:
    from hydra.core.utils import JobReturn, JobStatus

    try:
        overrides = list(job.submission().args[0])  # the plugin submits (overrides, job_dir_key, num, id, state)
    except Exception:  # the submission pickle is gone: the overrides are in the job's outcome.json anyway
        overrides = []
    parts = str(exc).split("-" * 22 + "\n")  # FailedJobError: "... with trace:", the task's error between rules
    if len(parts) > 2:
        reason = next((line for line in reversed(parts[1].splitlines()) if line.strip()), "")
    else:  # UncompletedJobError: "Job ID (task: N) with path ...\nhas not produced any output (state: STATE)"
        reason = " ".join(str(exc).splitlines()[1:2]) or str(exc)
    return JobReturn(overrides=overrides, status=JobStatus.COMPLETED,
                     _return_value={"status": "failed", "overrides": overrides,
                                    "error": f"submitit job {job.job_id} failed: {reason}"})


def wait_for_every_job() -> None:
    """In the submitting command, before the launcher runs: its ``launch`` waits for every job (``every_job``)."""
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

    if not getattr(BaseSubmititLauncher.launch, "hydraddp_every_job", False):
        BaseSubmititLauncher.launch = every_job(BaseSubmititLauncher.launch)  # type: ignore[method-assign]
