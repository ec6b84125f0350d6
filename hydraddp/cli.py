"""What ``python -m hydraddp`` does with a composed config: validate, launch, and exit with the contract's codes.

| code | meaning |
| 0 | success | 2 | invalid configuration, before any worker starts | 1 | a worker failed | 130 | Ctrl-C |
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hydraddp.config.overrides import normalize_overrides
from hydraddp.distributed.env import detect_launch_env

EXIT_OK, EXIT_WORKER_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130
_state = {"task_started": False}


def prepare_argv(argv: list[str]) -> list[str]:
    """Make argv safe for Hydra under outside launchers.

    - ``--local_rank=N`` / ``--local-rank=N`` (torch.distributed.launch) is dropped: the rank is in the env.
    - Ranks other than 0 under torchrun/SLURM write no job directory of their own; they adopt rank 0's.
    - ``experiment=NAME`` is spelled as Hydra needs it (see ``normalize_overrides``).
    """
    argv = normalize_overrides([a for a in argv if not re.fullmatch(r"--local[_-]rank(=\d+)?", a)])
    launch = detect_launch_env()
    if launch is not None and launch.rank != 0:
        argv += ["hydra.output_subdir=null", "hydra.run.dir=."]
    return argv


def _remove_if_unused(job_dir: Path) -> None:
    """Remove a job directory that holds nothing but Hydra's own copy of the config."""
    if job_dir.is_dir() and all(p.name == ".hydra" for p in job_dir.iterdir()):
        shutil.rmtree(job_dir, ignore_errors=True)


def _report_problems(problems: list, job_dir: Path) -> None:
    print("hydraddp: invalid configuration; nothing was started:", file=sys.stderr)
    for problem in problems:
        print(f"- {problem}", file=sys.stderr)
    _remove_if_unused(job_dir)  # no half-written run is left behind


def run(cfg: DictConfig) -> dict[str, Any]:
    """Validate ``cfg`` and launch it. In a single run, exits with the contract's code; in a sweep, returns
    the job's outcome (the sweep goes on after a failed job) for the summary table."""
    from hydraddp.config.validate import problems

    _state["task_started"] = True
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    outcome: dict[str, Any] = {"job_dir": str(job_dir), "overrides": list(hydra_cfg.overrides.task)}

    found = problems(cfg)
    if found:
        _report_problems(found, job_dir)
        if not sweeping:
            sys.exit(EXIT_INVALID)
        return {**outcome, "status": "invalid", "error": str(found[0])}

    from hydraddp.distributed import WorkerFailedError
    from hydraddp.launch import launch

    try:
        rank, result = launch(cfg, job_dir)
    except WorkerFailedError as exc:
        print(f"hydraddp: {exc}. Logs: {job_dir / 'logs'}", file=sys.stderr)
        if not sweeping:
            sys.exit(EXIT_WORKER_FAILED)
        return {**outcome, "status": "failed", "error": str(exc)}
    if result["job_dir"] != str(job_dir):
        _remove_if_unused(job_dir)  # this node's ranks logged into rank 0's job directory instead
    if rank == 0:  # under torchrun every rank gets here; one report is enough
        print(f"hydraddp: done. {result['steps']} steps at world size {result['world_size']}: loss "
              f"{result['final_loss']:.4f}, eval accuracy {result['eval_accuracy']:.3f}, "
              f"{result['samples_per_s']:.0f} samples/s. Job directory: {result['job_dir']}", flush=True)
    return {**outcome, "status": "ok", **result}


def main(hydra_main: Any, argv: list[str]) -> None:
    """Run Hydra's main with the contract's exit codes: a config Hydra cannot compose exits 2, Ctrl-C 130."""
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
