"""What ``python -m hydraddp`` does with a composed config: decide the launch (``hydraddp.job``), start its MLflow run,
launch, and exit with the contract's codes.

| code | meaning |
| 0 | success | 2 | invalid configuration, before any worker starts | 1 | a worker failed | 3 | preempted (a complete
checkpoint was written) | 130 | Ctrl-C |
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hydraddp.config.overrides import normalize_overrides
from hydraddp.distributed.env import JOIN_TIMEOUT_ENV, detect_launch_env, slurm_allocation_outside_step
from hydraddp.exit_codes import (EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, EXIT_PREEMPTED, EXIT_WORKER_FAILED,
                                 LaunchEnded)
from hydraddp.handoff.launch_result import OUTCOME_FILE, RESULT_FILE
from hydraddp.tracking import names


def prepare_argv(argv: list[str]) -> list[str]:
    """Make argv safe for Hydra under outside launchers.

    - ``--local_rank=N`` / ``--local-rank=N`` (torch.distributed.launch) is dropped: the rank is in the env.
    - Ranks other than 0 under torchrun/SLURM write no job directory of their own; they adopt rank 0's.
    - ``experiment=NAME`` is spelled as Hydra needs it (see ``normalize_overrides``).
    - In a Kubeflow PyTorchJob pod, the operator's variables are the defaults of ``launcher.*`` (``pytorchjob.pod_overrides``).
    - A submitit launcher runs one launch as a sweep of one job (``hydraddp.clusters.submitit.prepare_argv``).
    """
    from hydraddp.clusters import pytorchjob
    from hydraddp.clusters import submitit as submitit_launch

    argv = normalize_overrides([a for a in argv if not re.fullmatch(r"--local[_-]rank(=\d+)?", a)])
    argv = [*argv, *pytorchjob.pod_overrides(os.environ, argv[1:])]
    argv = submitit_launch.prepare_argv(argv)
    launch = detect_launch_env()
    if launch is not None and launch.rank != 0:
        argv += ["hydra.output_subdir=null", "hydra.run.dir=."]
    return argv


def _remove_if_untouched(job_dir: Path) -> None:
    """Remove a job directory that holds only Hydra's copy of the config. (Ranks other than 0 under torchrun
    run in "." with no copy: nothing of theirs to remove.)"""
    if HydraConfig.get().output_subdir is not None and all(p.name == ".hydra" for p in job_dir.iterdir()):
        shutil.rmtree(job_dir, ignore_errors=True)


def _report_problems(problems: list, job_dir: Path) -> None:
    print("hydraddp: invalid configuration; nothing was started:", file=sys.stderr)
    for problem in problems:
        print(f"- {problem}", file=sys.stderr)
    _remove_if_untouched(job_dir)  # no half-written run is left behind


def _ended(outcome: dict[str, Any], sweeping: bool, code: int) -> dict[str, Any]:
    """The end of a launch: its exit code, or in a sweep its outcome (the sweep goes on), which is kept in the job
    directory too: a launcher that runs the jobs elsewhere (submitit) gives the sweep's summary nothing else to read.
    (An invalid job's directory is gone: nothing is left there.) A submitit task whose launch was refused or failed
    then fails for submitit and Slurm (``clusters.submitit.fail``); a preempted one was requeued before this."""
    if not sweeping:
        if code != EXIT_OK:
            raise LaunchEnded(code)
        return outcome
    from hydraddp.clusters import submitit as submitit_task

    launch = detect_launch_env()
    job_dir = Path(outcome["job_dir"])
    if submitit_task.in_task() and (launch is None or launch.rank == 0):
        job_dir.mkdir(parents=True, exist_ok=True)  # even refused: the submitting command reads how its job ended here
    if (launch is None or launch.rank == 0) and job_dir.is_dir():
        (job_dir / OUTCOME_FILE).write_text(json.dumps(outcome, indent=1, default=str))
    if submitit_task.in_task() and code not in (EXIT_OK, EXIT_PREEMPTED):
        submitit_task.fail(getattr(launch, "rank", 0), code, str(outcome.get("error", outcome.get("status"))))
    return outcome


def run(cfg: DictConfig) -> dict[str, Any]:
    """Plan ``cfg``'s launch and run it. In a single run, exits with the contract's code; in a sweep, returns
    the job's outcome (the sweep goes on after a failed job) for the summary table."""
    from hydraddp.clusters import submitit as submitit_task
    from hydraddp.job import prepare

    if submitit_task.in_task():
        submitit_task.attach()  # this task is one rank of the job's world: before anything asks who it is
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    outcome: dict[str, Any] = {"job_dir": str(job_dir), "overrides": overrides}

    from hydraddp.preflight import claim

    try:
        try:
            job = prepare(cfg, job_dir, overrides, sweeping, hydra_cfg.job.get("num") or 0, _remove_if_untouched)
        except Exception as exc:
            _tell_peers(cfg, f"{type(exc).__name__}: {exc}")
            raise
        if isinstance(job, list):
            _report_problems(job, job_dir)
            _tell_peers(cfg, f"invalid configuration: {str(job[0]).strip()}")
            return _ended({**outcome, "status": "invalid", "error": str(job[0])}, sweeping, EXIT_INVALID)
        return _start(job, outcome)
    finally:
        claim.release()  # the checkpoint.dir preflight claimed for this launch: the next launch (or job) may use it


def _tell_peers(cfg: DictConfig, reason: str) -> None:
    """This rank of an attached launch (srun, submitit) will not start: the others, waiting for it to form the group,
    end now with ``reason`` rather than at ``launcher.timeout`` (under torchrun its agent stops them)."""
    launch = detect_launch_env()
    if launch is None or launch.world_size == 1:
        return
    import datetime

    from hydraddp.distributed.join import refuse

    timeout = cfg.launcher.get("timeout")
    refuse(reason, datetime.timedelta(seconds=timeout if isinstance(timeout, (int, float)) and timeout > 0 else 600))


def _start(job: Any, outcome: dict[str, Any]) -> dict[str, Any]:
    """Start the launch's MLflow run and its node trackers, then launch."""
    outcome["job_dir"] = str(job.job_dir)
    for warning in job.warnings:
        print(f"hydraddp: warning: {warning}", file=sys.stderr, flush=True)
    os.environ[names.LAUNCHED_AT_ENV] = repr(job.started_at)  # the workers' perf/startup_s counts from here
    os.environ[JOIN_TIMEOUT_ENV] = str(job.config["launcher"]["timeout"])  # how long attached ranks wait for peers
    slurm_job = slurm_allocation_outside_step()
    if slurm_job is not None:
        print(f"hydraddp: in Slurm job {slurm_job} but not in an srun step: launching "
              f"{job.config['launcher']['nproc_per_node']} local worker(s) as configured (start under srun to "
              "attach).", file=sys.stderr, flush=True)
    tracker = None
    if job.tracks:
        from hydraddp.tracking.setup import launch_run

        tracker = launch_run(job)
        # The launch imports torch next, and so does the tracker, to log the model: imported here first, the tracker
        # forked after it starts with it (about 2 CPU-seconds it would spend again), and with MLflow where this
        # process has it (a sweep's; the fork leaves its database connections: tracking/process.py).
        import torch  # noqa: F401

        tracker.start(fork=sys.platform == "linux")
    from hydraddp.tracking.node import for_launch

    node = for_launch(job, tracker)  # over several nodes: each one's system metrics and logs into the run
    try:
        return _launch(job, tracker, outcome)
    finally:
        if node is not None:
            node.finish(job.config["tracking"]["flush_timeout_s"])


def _launch(job: Any, tracker: Any, outcome: dict[str, Any]) -> dict[str, Any]:
    from hydraddp.distributed import WorkerFailedError
    from hydraddp.launch import launch
    from hydraddp.tracking.run import FAILED, FINISHED, KILLED

    if tracker and job.config["plan"]["record"]:
        from hydraddp.launch import plan_recording

        tracker.plan_with(plan_recording(job))
    flush_s = job.config["tracking"]["flush_timeout_s"]
    try:
        rank, result = launch(job, tracker.events_path if tracker else None)
    except WorkerFailedError as exc:
        return _worker_failed(exc, job, tracker, outcome)
    except BaseException as exc:
        preempted = _preemption_since(job)
        if preempted is not None:
            # torch's agent got the signal too: it passed it on, waited for the workers' checkpoint, then raised
            return _stop_preempted(preempted, job, tracker, outcome, rank=0)
        from hydraddp.distributed.join import GroupNotFormedError

        if isinstance(exc, GroupNotFormedError):
            return _group_not_formed(exc, job, tracker, outcome)
        attached = detect_launch_env()
        if attached is not None and isinstance(exc, Exception):
            # Attached (torchrun, srun), this process is the worker: its failure is a worker's (exit 1), not a
            # config Hydra could not compose, which is what Hydra's own exit 1 would be taken for.
            failed = WorkerFailedError(attached.rank, f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            return _worker_failed(failed, job, tracker, outcome)
        if tracker:
            tracker.finish(KILLED if isinstance(exc, KeyboardInterrupt) else FAILED, error=repr(exc), timeout_s=flush_s)
        raise
    if result.get("preempted"):
        return _stop_preempted(result["preempted"], job, tracker, outcome, rank)
    if tracker:
        tracker.finish(FINISHED, timeout_s=flush_s)
        result["run_id"] = tracker.run_id
    if job.leads:  # under torchrun every rank gets here, on several nodes every launcher: one report is enough
        from hydraddp.handoff.preemption import retire_marker

        retire_marker(job.job_dir)  # a rerun in this directory starts afresh
        (job.job_dir / RESULT_FILE).write_text(json.dumps({"run_id": None, **result}, indent=1))
        run = ""
        if tracker:  # a server that refused every request left no run: never "MLflow run None"
            run = (f" MLflow run {tracker.run_id} at {tracker.uri}." if tracker.run_id else
                   f" No MLflow run could be created at {tracker.uri}; the points are kept in {tracker.events_path}.")
        evaluated = ", ".join(f"eval {name} {value:.3f}" for name, value in result["eval_metrics"].items())
        print(f"hydraddp: done. {result['steps']} steps at world size {result['world_size']}: loss "
              f"{result['final_loss']:.4f}, {evaluated}, "
              f"{result['samples_per_s']:.0f} samples/s{_mfu(result.get('mfu'))}. Job directory: {result['job_dir']}.{run}",
              flush=True)
    return _ended({**outcome, "status": "ok", **result}, job.sweeping, EXIT_OK)


def _worker_failed(exc: Any, job: Any, tracker: Any, outcome: dict[str, Any]) -> dict[str, Any]:
    """A worker failed (``WorkerFailedError``): the run is FAILED, and the launch exits 1, or 2 where the workers
    found the config invalid before training (a checkpoint root that not every node sees)."""
    from hydraddp.distributed import ConfigurationError
    from hydraddp.tracking.run import FAILED

    if tracker:
        tracker.finish(FAILED, error=f"{exc}\n\n{exc.traceback}", timeout_s=job.config["tracking"]["flush_timeout_s"])
    invalid = exc.error.startswith(f"{ConfigurationError.__name__}: ")
    if invalid:
        print(f"hydraddp: invalid configuration (rank {exc.rank}, before training):\n"
              f"{exc.error.split(': ', 1)[1]}", file=sys.stderr)
    else:
        print(failure_block(exc, job.job_dir / "logs" / f"rank{exc.rank}.log"), file=sys.stderr)
    return _ended({**outcome, "status": "invalid" if invalid else "failed", "error": str(exc),
                   "run_id": tracker.run_id if tracker else None}, job.sweeping,
                  EXIT_INVALID if invalid else EXIT_WORKER_FAILED)


def _group_not_formed(exc: Any, job: Any, tracker: Any, outcome: dict[str, Any]) -> dict[str, Any]:
    """Another rank refused to start, or never joined: one line and exit 1, no traceback (the cause is in that rank's
    log, not here)."""
    from hydraddp.tracking.run import FAILED

    if exc.refused_by is not None:
        why = f"rank {exc.refused_by} refused to start: {exc.reason}"
    else:
        why = f"rank {', '.join(map(str, exc.missing))} did not join within launcher.timeout={exc.timeout_s:g} s"
    first = exc.refused_by if exc.refused_by is not None else exc.missing[0]
    message = f"{why}: see rank {first}'s log"
    rank = getattr(detect_launch_env(), "rank", "?")
    print(f"hydraddp: rank {rank} stopped before training: {message}", file=sys.stderr, flush=True)
    if tracker:
        tracker.finish(FAILED, error=message, timeout_s=job.config["tracking"]["flush_timeout_s"])
    return _ended({**outcome, "status": "failed", "error": message, "run_id": tracker.run_id if tracker else None},
                  job.sweeping, EXIT_WORKER_FAILED)


def _mfu(mfu: float | None) -> str:
    return f" at {mfu:.1%} MFU" if mfu is not None else ""


def _preemption_since(job: Any) -> dict[str, Any] | None:
    """The preemption this launch's workers recorded, if they did (the marker has an entry more than at start)."""
    from hydraddp.handoff.preemption import checkpointed_preemptions

    entries = checkpointed_preemptions(job.job_dir)
    return entries[-1] if len(entries) > job.preemptions else None


def _stop_preempted(preempted: dict[str, Any], job: Any, tracker: Any, outcome: dict[str, Any],
                    rank: int) -> dict[str, Any]:
    """Every rank checkpointed the same step after a stop signal: the run is marked so (KILLED, with the
    ``hydraddp.preempted`` tag), then submitit requeues the job, or the launch exits with ``EXIT_PREEMPTED``."""
    from hydraddp.clusters import submitit as submitit_task

    if tracker:
        from hydraddp.tracking.events import EventWriter
        from hydraddp.tracking.run import KILLED

        writer = EventWriter(tracker.events_path)
        writer.tag(names.TAG_PREEMPTED, json.dumps(preempted))
        writer.close()
        tracker.finish(KILLED, error=f"preempted by {preempted['signal']} after step {preempted['step']}",
                       timeout_s=job.config["tracking"]["flush_timeout_s"])
    error = f"preempted at step {preempted['step']}"
    if submitit_task.in_task():  # requeued (this process ends), unless submitit will not requeue it again
        error += f"; {submitit_task.requeue(rank, EXIT_PREEMPTED, preempted['signal'])}"
    if job.leads:
        print(f"hydraddp: stopped by {preempted['signal']} after step {preempted['step']}: every rank wrote checkpoint "
              f"{preempted['checkpoint']}. Resume with the same command and hydra.run.dir={job.job_dir} "
              f"(or checkpoint.resume={preempted['checkpoint']}).", file=sys.stderr, flush=True)
    return _ended({**outcome, "status": "preempted", "error": error}, job.sweeping, EXIT_PREEMPTED)


LAST_FRAMES = 3


def failure_block(exc: Any, log_file: Path) -> str:
    """A worker's failure in a few lines: the rank and its error, the last frames, and where the whole
    traceback is (the rank's log)."""
    frames = re.findall(r'^  File "([^"]+)", line (\d+), in (\S+)\n(?:    (.+)\n)?', exc.traceback, re.M)
    lines = [f"hydraddp: {exc}"]
    for path, line, function, code in frames[-LAST_FRAMES:]:
        lines.append(f"  {path}:{line} in {function}" + (f": {code.strip()}" if code else ""))
    where = log_file if log_file.exists() else log_file.parent
    lines.append(f"  full traceback: {where}")
    return "\n".join(lines)


def main(hydra_main: Any, argv: list[str], started_at: float | None = None) -> None:
    """Run Hydra's main with the contract's exit codes: a config Hydra cannot compose exits 2, Ctrl-C 130.

    ``started_at``: when the command started (``time.time()``), for ``perf/startup_s``.
    """
    if started_at is not None:
        os.environ[names.LAUNCHED_AT_ENV] = repr(started_at)
    sys.argv = prepare_argv(argv)
    try:
        hydra_main()
    except KeyboardInterrupt:
        print("hydraddp: interrupted; every worker was stopped", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except LaunchEnded:
        raise
    except SystemExit as exc:
        if exc.code == 1:
            # Hydra reports composition errors (unknown option, misspelled key, wrong type) and exits 1.
            print("hydraddp: invalid configuration (above); `python -m hydraddp --help` lists every group's options",
                  file=sys.stderr)
            sys.exit(EXIT_INVALID)
        raise
