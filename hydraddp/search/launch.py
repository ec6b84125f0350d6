"""How a trial runs: the sweeper's own launch with the trial's values (``launch_arguments``), in a job directory of
its own, on GPUs of its own when the node's are split between the trials running at once (``gpu_slots``); its
result read back (``run_trial``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from hydraddp.handoff.launch_result import RESULT_FILE
from hydraddp.handoff.trial import TRIAL_ENV, metric_value


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
        elif source.provider == "main" and Path(source.path).resolve() != CONF_DIR.resolve():
            found.append(f"--config-path={source.path}")
    if hydra.job.config_name != "config":
        found.append(f"--config-name={hydra.job.config_name}")
    return found + [o for o in hydra.overrides.hydra if not _SWEEPERS_OWN.match(o)]


def trial_output(job_dir: Path) -> list[str]:
    """Where a trial writes: ``job_dir``, as one launch (``hydra.run.dir``) and as one job of a submitit launcher,
    which runs it as a sweep of one (its job directory ``hydra.sweep.dir``/``subdir``)."""
    return [f"hydra.run.dir={job_dir}", f"hydra.sweep.dir={job_dir}", "hydra.sweep.subdir=."]


def run_trial(command: list[str], job_dir: Path, spec: dict[str, Any], metrics: list[str],
              env: dict[str, str] | None = None, budget: Budget | None = None) -> dict[str, Any]:
    """One trial: ``command`` (``python -m hydraddp`` with the sweeper's launch arguments and the trial's values)
    writing in ``job_dir``, with ``env`` added to the sweeper's environment; its result (``handoff.launch_result``)
    and the last value of each of ``metrics``, or why it failed (an exit 2 gives its message). With a ``budget``, a
    trial whose plan does not fit it is not launched: ``{"status": "over_budget", ...}``, in seconds."""
    if budget is not None:
        over = budget.exceeded()
        if over:
            return {"status": "over_budget", "error": over}
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
    values = [result_metric(metric, result) for metric in metrics]
    return {"status": "ok", "values": values, "pruned_step": result.get("pruned_step"), "run_id": result.get("run_id")}


@dataclass
class Budget:
    """A trial's config (resolved, as a launch decides it) and the memory one rank may use: its plan must fit."""

    config: dict[str, Any]
    world_size: int
    budget_gb: float

    def exceeded(self) -> str | None:
        """Why the trial's plan does not fit (its planned peak per rank), or None when it fits. A config the plan
        cannot simulate is launched: the launch is the judge then."""
        from hydraddp.plan.record import plan_elsewhere

        peak = plan_elsewhere(self.config, self.world_size).get("peak_bytes")
        if peak is None or peak <= self.budget_gb * 2**30:
            return None
        return (f"its plan's peak is {peak / 2**30:.3g} GiB per rank, over the memory budget of {self.budget_gb:g} "
                "GiB: not launched")


RESULT_METRICS = {"perf/samples_per_s": lambda r: r.get("samples_per_s"), "perf/mfu": lambda r: r.get("mfu"),
                  # the largest rank's peak device (or host) memory over the run, in GiB
                  "memory/peak_gib": lambda r: max(r.get("peak_memory_bytes") or [0]) / 2**30 or None,
                  # the largest rank's tensor peak over its second step (what the plan predicts; plan.measure)
                  "memory/peak_tensor_gib": lambda r: max((p["peak_bytes"] for p in r.get("tensor_peaks") or []),
                                                          default=0) / 2**30 or None}


def known_metric(metric: str) -> bool:
    """Whether a launch ends with ``metric``: ``eval/<name>``, ``train/loss``, or one of ``RESULT_METRICS``."""
    return metric.startswith("eval/") or metric == "train/loss" or metric in RESULT_METRICS


def result_metric(metric: str, result: dict[str, Any]) -> float | None:
    """The metric's last value in a launch's result: its final evaluation, its last loss, its throughput, its peak
    memory."""
    value = metric_value(metric, result.get("eval_metrics") or {}, result.get("final_loss"))
    if value is None and metric in RESULT_METRICS:
        value = RESULT_METRICS[metric](result)
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
