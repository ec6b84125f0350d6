"""What ``python -m hydraddp`` does with a composed config: validate, launch, and exit with the contract's codes.

| code | meaning |
| 0 | success | 2 | invalid configuration, before any worker starts | 1 | a worker failed | 130 | Ctrl-C |
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hydraddp.config.overrides import normalize_overrides
from hydraddp.distributed.env import detect_launch_env, slurm_allocation_outside_step
from hydraddp.tracking import names

EXIT_OK, EXIT_WORKER_FAILED, EXIT_INVALID, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
OUTCOME_FILE = "outcome.json"  # in a sweep job's directory: what the job's launch ended with, for the summary
RESULT_FILE = "result.json"  # in the job directory: rank 0's TrainResult
_state: dict[str, Any] = {"task_started": False, "started_at": None}


def prepare_argv(argv: list[str]) -> list[str]:
    """Make argv safe for Hydra under outside launchers.

    - ``--local_rank=N`` / ``--local-rank=N`` (torch.distributed.launch) is dropped: the rank is in the env.
    - Ranks other than 0 under torchrun/SLURM write no job directory of their own; they adopt rank 0's.
    - ``experiment=NAME`` is spelled as Hydra needs it (see ``normalize_overrides``).
    - In a Kubeflow PyTorchJob pod, the operator's variables are the defaults of ``launcher.*`` (``kube.pod_overrides``).
    - A submitit launcher runs one launch as a sweep of one job (``hydraddp.clusters.submitit.prepare_argv``).
    """
    from hydraddp.clusters import kube
    from hydraddp.clusters import submitit as submitit_launch

    argv = normalize_overrides([a for a in argv if not re.fullmatch(r"--local[_-]rank(=\d+)?", a)])
    argv = [*argv, *kube.pod_overrides(os.environ, argv[1:])]
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


def _resume_problems(cfg: DictConfig, job_dir: Path) -> tuple[list, dict[str, Any] | None]:
    """Resolve ``checkpoint.resume`` once, here, and check it holds this model (on the meta device: no memory,
    no process group). A resumed run continues its MLflow run unless told otherwise. Returns the problems
    and, for the run's history, where the resume starts."""
    if not cfg.checkpoint.resume:
        return [], None
    from hydraddp.distributed.compat import Problem
    from hydraddp.train.checkpoint import CheckpointError, check_model_matches, check_readable, find, read_meta

    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else job_dir / "checkpoints"
    try:
        path = find(root, cfg.checkpoint.resume)
        meta = read_meta(path)
        check_readable(path)
        check_model_matches(path, cfg.model)
    except CheckpointError as exc:
        return [Problem(("checkpoint.resume",), str(exc), "")], None
    cfg.checkpoint.resume = str(path.resolve())
    run_id_file = Path(meta["job_dir"], names.RUN_ID_FILE) if meta.get("job_dir") else None
    run_id = meta.get("run_id") or (run_id_file.read_text().strip() if run_id_file and run_id_file.exists() else None)
    if not cfg.tracking.run_id and run_id:
        cfg.tracking.run_id = run_id
    return [], {"checkpoint": cfg.checkpoint.resume, "step": meta["step"]}


def _launch_job_dir(job_dir: Path) -> tuple[Path, bool]:
    """The launch's job directory, and whether this is a restart. Rank 0 under torchrun asks the agent: after
    ``torchrun --max-restarts`` restarted the group, it goes on in the first attempt's directory, with that
    attempt's run and checkpoints, and the directory Hydra just made is removed."""
    attached = detect_launch_env()
    if attached is None or attached.rank != 0 or attached.world_size == 1:
        return job_dir, False
    from hydraddp.launch import job_dir_from_agent

    agreed = job_dir_from_agent(str(job_dir))
    if agreed is None or Path(agreed) == job_dir:
        return job_dir, False
    _remove_if_untouched(job_dir)
    return Path(agreed), True


def _resume_after_preemption(cfg: DictConfig, job_dir: Path) -> int:
    """A launch in the job directory of a preempted one (a requeued job, or a rerun with ``hydra.run.dir``) goes on
    from its checkpoint. Returns how many preemptions the job has had (0: none)."""
    from hydraddp.train.preemption import resume_point

    checkpoint, preemptions = resume_point(job_dir)
    if checkpoint and not cfg.checkpoint.resume:
        cfg.checkpoint.resume = checkpoint
    return preemptions


def _tracks_here(cfg: DictConfig) -> bool:
    """The launch's one MLflow run lives in rank 0's process under torchrun, else in node 0's launcher."""
    launch = detect_launch_env()
    return cfg.tracking.enabled and (launch.rank == 0 if launch is not None else cfg.launcher.node_rank == 0)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Validate ``cfg`` and launch it. In a single run, exits with the contract's code; in a sweep, returns
    the job's outcome (the sweep goes on after a failed job) for the summary table."""
    from hydraddp.clusters import submitit as submitit_task
    from hydraddp.config.validate import combination_of, problems
    from hydraddp.distributed.compat import Problem, resolve_wrap

    _state["task_started"] = True
    if submitit_task.in_task():
        submitit_task.attach()  # this task is one rank of the job's world: before anything asks who it is
    # perf/startup_s counts from the command for the first job, from the job's own start in a sweep.
    started_at, _state["started_at"] = _state["started_at"] or time.time(), None
    os.environ[names.LAUNCHED_AT_ENV] = repr(started_at)
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    outcome: dict[str, Any] = {"job_dir": str(job_dir), "overrides": overrides}

    found = problems(cfg)
    requeues = _resume_after_preemption(cfg, job_dir) if not found else 0
    resume_problems, resumed_from = _resume_problems(cfg, job_dir) if not found else ([], None)
    found += resume_problems
    tracks = _tracks_here(cfg)
    if tracks and not found:
        from hydraddp.tracking.setup import preflight, tracking_uri

        unreachable = preflight(tracking_uri(cfg))
        if unreachable:
            found.append(Problem(("tracking.uri",), f"tracking.uri: {unreachable}.",
                                 "Start the server, point tracking.uri at a running one, or set tracking.enabled=false."))
    if found:
        _report_problems(found, job_dir)
        if not sweeping:
            sys.exit(EXIT_INVALID)
        return _ended(job_dir, {**outcome, "status": "invalid", "error": str(found[0])}, sweeping)

    slurm_job = slurm_allocation_outside_step()
    if slurm_job is not None:
        print(f"hydraddp: in Slurm job {slurm_job} but not in an srun step: launching "
              f"{cfg.launcher.nproc_per_node} local worker(s) as configured (start under srun to attach).",
              file=sys.stderr, flush=True)
    from hydraddp.launch import launch, redacted, resolved

    job_dir, restarted = _launch_job_dir(job_dir)
    outcome["job_dir"] = str(job_dir)
    plain = resolved(cfg)  # once, here: the workers and the tracker get the same resolved config
    tracker = None
    if tracks:
        from hydraddp.tracking.run import FAILED, FINISHED, KILLED
        from hydraddp.tracking.setup import launch_run

        combo = combination_of(cfg)
        tracker = launch_run(cfg, plain, job_dir, overrides, resolve_wrap(combo), combo.world_size, resumed_from,
                             restarted, {names.TAG_REQUEUES: str(requeues)} if requeues else None)
        tracker.start()  # before this process imports torch: mlflow loads on the core that leaves idle
    from hydraddp.distributed import ConfigurationError, WorkerFailedError  # torch: after the tracker started

    events_path = tracker.events_path if tracker else None
    try:
        rank, result = launch(plain, job_dir, events_path, redacted(cfg, plain))
    except WorkerFailedError as exc:
        if tracker:
            tracker.finish(FAILED, error=f"{exc}\n\n{exc.traceback}", timeout_s=cfg.tracking.flush_timeout_s)
        invalid = exc.error.startswith(f"{ConfigurationError.__name__}: ")
        if invalid:  # found by the workers before training (a checkpoint root that not every node sees)
            print(f"hydraddp: invalid configuration (rank {exc.rank}, before training):\n"
                  f"{exc.error.split(': ', 1)[1]}", file=sys.stderr)
        else:
            print(failure_block(exc, job_dir / "logs" / f"rank{exc.rank}.log"), file=sys.stderr)
        if not sweeping:
            sys.exit(EXIT_INVALID if invalid else EXIT_WORKER_FAILED)
        return _ended(job_dir, {**outcome, "status": "invalid" if invalid else "failed", "error": str(exc),
                                "run_id": tracker.run_id if tracker else None}, sweeping)
    except BaseException as exc:
        preempted = _preemption_since(job_dir, requeues)
        if preempted is not None:
            # torch's agent got the signal too: it passed it on, waited for the workers' checkpoint, then raised
            return _stop_preempted(preempted, tracker, cfg, outcome, sweeping, rank=0)
        if tracker:
            tracker.finish(KILLED if isinstance(exc, KeyboardInterrupt) else FAILED, error=repr(exc),
                           timeout_s=cfg.tracking.flush_timeout_s)
        raise
    if result.get("preempted"):
        return _stop_preempted(result["preempted"], tracker, cfg, outcome, sweeping, rank)
    if tracker:
        tracker.finish(FINISHED, timeout_s=cfg.tracking.flush_timeout_s)
        result["run_id"] = tracker.run_id
    if rank == 0:  # under torchrun every rank gets here; one report is enough
        from hydraddp.train.preemption import retire_marker

        retire_marker(job_dir)  # a rerun in this directory starts afresh
        (job_dir / RESULT_FILE).write_text(json.dumps({"run_id": None, **result}, indent=1))
        run = f" MLflow run {tracker.run_id} at {tracker.uri}." if tracker else ""
        evaluated = ", ".join(f"eval {name} {value:.3f}" for name, value in result["eval_metrics"].items())
        print(f"hydraddp: done. {result['steps']} steps at world size {result['world_size']}: loss "
              f"{result['final_loss']:.4f}, {evaluated}, "
              f"{result['samples_per_s']:.0f} samples/s. Job directory: {result['job_dir']}.{run}", flush=True)
    return _ended(job_dir, {**outcome, "status": "ok", **result}, sweeping)


def _ended(job_dir: Path, outcome: dict[str, Any], sweeping: bool) -> dict[str, Any]:
    """A sweep job's outcome, kept in its job directory too: a launcher that runs the jobs elsewhere (submitit)
    gives the sweep's summary nothing else to read. (An invalid job's directory is gone: nothing is left there.)"""
    launch = detect_launch_env()
    if sweeping and (launch is None or launch.rank == 0) and job_dir.is_dir():
        (job_dir / OUTCOME_FILE).write_text(json.dumps(outcome, indent=1, default=str))
    return outcome


def _preemption_since(job_dir: Path, requeues: int) -> dict[str, Any] | None:
    """The preemption this launch's workers recorded, if they did (the marker has an entry more than at start)."""
    from hydraddp.train.preemption import read_marker

    entries = [e for e in read_marker(job_dir) if e.get("checkpoint")]
    return entries[-1] if len(entries) > requeues else None  # one more than at the start: this launch's


def _stop_preempted(preempted: dict[str, Any], tracker: Any, cfg: DictConfig, outcome: dict[str, Any],
                    sweeping: bool, rank: int) -> dict[str, Any]:
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
                       timeout_s=cfg.tracking.flush_timeout_s)
    if submitit_task.in_task():
        submitit_task.requeue(rank, EXIT_PREEMPTED)
    if rank == 0:
        print(f"hydraddp: stopped by {preempted['signal']} after step {preempted['step']}: every rank wrote checkpoint "
              f"{preempted['checkpoint']}. Resume with the same command and hydra.run.dir={outcome['job_dir']} "
              f"(or checkpoint.resume={preempted['checkpoint']}).", file=sys.stderr, flush=True)
    if not sweeping:
        sys.exit(EXIT_PREEMPTED)
    return _ended(Path(outcome["job_dir"]), {**outcome, "status": "preempted",
                                             "error": f"preempted at step {preempted['step']}"}, sweeping)


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
    _state["started_at"] = started_at
    sys.argv = prepare_argv(argv)
    try:
        hydra_main()
    except KeyboardInterrupt:
        print("hydraddp: interrupted; every worker was stopped", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit as exc:
        if exc.code == 1 and not _state["task_started"]:
            # Hydra reports composition errors (unknown option, misspelled key, wrong type) and exits 1.
            print("hydraddp: invalid configuration (above); `python -m hydraddp --help` lists every group's options",
                  file=sys.stderr)
            sys.exit(EXIT_INVALID)
        raise
