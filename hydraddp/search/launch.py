"""How a trial runs: the sweeper's own launch with the trial's values (``launch_arguments``), in a job directory of
its own, on GPUs of its own when the node's are split between the trials running at once (``gpu_slots``); its
result read back (``run_trial``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from hydraddp.search.trial import TRIAL_ENV, metric_value


_SWEEPERS_OWN = re.compile(r"^[+~]*(hydra/sweeper(/|=)|hydra\.sweeper\.|hydra\.sweep\.|hydra\.run\.|hydra\.mode=)")


def launch_arguments(config: DictConfig) -> list[str]:
    """What makes a trial the sweeper's own launch, besides the trial's values: the sweeper's ``--config-dir``,
    ``--config-path`` and ``--config-name``, and every ``hydra.*`` override (its launcher among them) except the
    sweeper's own and the run dir, which each trial has of its own."""
    from hydraddp.config.compose import CONF_DIR

    hydra = config.hydra
    found = []
    for source in hydra.runtime.config_sources:
        if source.schema != "file":
            continue
        if source.provider == "command-line":
            found.append(f"--config-dir={source.path}")
        elif source.provider == "main" and Path(source.path).resolve() != CONF_DIR:
            found.append(f"--config-path={source.path}")
    if hydra.job.config_name != "config":
        found.append(f"--config-name={hydra.job.config_name}")
    return found + [o for o in hydra.overrides.hydra if not _SWEEPERS_OWN.match(o)]


def trial_output(job_dir: Path) -> list[str]:
    """Where a trial writes: ``job_dir``, as one launch (``hydra.run.dir``) and as one job of a submitit launcher,
    which runs it as a sweep of one (its job directory ``hydra.sweep.dir``/``subdir``)."""
    return [f"hydra.run.dir={job_dir}", f"hydra.sweep.dir={job_dir}", "hydra.sweep.subdir=."]


def run_trial(command: list[str], job_dir: Path, spec: dict[str, Any],
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """One trial: ``command`` (``python -m hydraddp`` with the sweeper's launch arguments and the trial's values)
    writing in ``job_dir``, with ``env`` added to the sweeper's environment; its result (``cli.RESULT_FILE``) and the
    metric's last value, or why it failed (an exit 2 gives its message)."""
    from hydraddp.cli import RESULT_FILE

    job_dir.parent.mkdir(parents=True, exist_ok=True)
    log = job_dir.parent / f"{job_dir.name}.log"
    env = {**os.environ, **(env or {}), TRIAL_ENV: json.dumps(spec)}
    with log.open("w") as out:
        code = subprocess.call([*command, *trial_output(job_dir)], stdout=out, stderr=subprocess.STDOUT, env=env)
    result_file = job_dir / RESULT_FILE
    if code != 0 or not result_file.exists():
        said = log.read_text()[-3000:]
        return {"status": "failed", "exit_code": code, "error": f"exit {code}: {said}"}
    result = json.loads(result_file.read_text())
    value = result_metric(spec["metric"], result)
    return {"status": "ok", "value": value, "pruned_step": result.get("pruned_step"), "run_id": result.get("run_id")}


def result_metric(metric: str, result: dict[str, Any]) -> float | None:
    """The metric's last value in a launch's result: its final evaluation, its last loss, its throughput."""
    value = metric_value(metric, result.get("eval_metrics") or {}, result.get("final_loss"))
    if value is None:
        value = {"perf/samples_per_s": result.get("samples_per_s"), "perf/mfu": result.get("mfu")}.get(metric)
    return None if value is None else float(value)


def gpu_slots(cfg: DictConfig, n_jobs: int, env: dict[str, str] | None = None,
              gpus_dir: Path | None = None) -> tuple[list[str], list[str]]:
    """The ``CUDA_VISIBLE_DEVICES`` of each of ``n_jobs`` local trials running at once: disjoint, of
    ``launcher.nproc_per_node`` GPUs each (``auto``: the visible ones shared evenly), and what makes that impossible.
    Nothing to split (no slots) on a node without GPUs, under a backend that does not use them, or when a submitit
    launcher runs the trials (its scheduler gives each job its GPUs)."""
    from hydraddp.parallel import machine
    from hydraddp.sweep import submitit_launched

    visible = machine.visible_nvidia_gpus(env, *([gpus_dir] if gpus_dir else []))
    if not visible or cfg.backend.name not in machine.GPU_BACKENDS or submitit_launched(cfg):
        return [], []
    nproc = cfg.launcher.nproc_per_node
    each = len(visible) // n_jobs if nproc == "auto" else int(nproc)
    if each < 1 or each * n_jobs > len(visible):
        fix = f"lower hydra.sweeper.n_jobs to {max(len(visible) // max(each, 1), 1)}"
        return [], [f"hydra.sweeper.n_jobs={n_jobs} trials at a time of launcher.nproc_per_node={nproc} need "
                     f"{n_jobs * max(each, 1)} GPUs, and {len(visible)} are visible here ({','.join(visible)}): {fix}, "
                     "or run the trials through hydra/launcher=slurm."]
    return [",".join(visible[i * each:(i + 1) * each]) for i in range(n_jobs)], []
