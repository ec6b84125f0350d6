"""The end of a ``-m`` sweep: one table of every job, and exit 1 if any job failed."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def _cell(value: Any, width: int, precision: int) -> str:
    return f"{value:{width}.{precision}f}" if isinstance(value, (int, float)) else "-".rjust(width)


def summary_table(outcomes: list[dict[str, Any]]) -> str:
    header = f"{'#':>2}  {'status':8} {'loss':>8} {'eval acc':>8} {'samples/s':>10}  overrides / error"
    lines = [header, "-" * len(header)]
    for num, out in enumerate(outcomes):
        detail = " ".join(out.get("overrides", []))
        if out.get("status") != "ok":
            detail += f"  ({out.get('error', '')})"
        lines.append(f"{num:>2}  {out.get('status', '?'):8} {_cell(out.get('final_loss'), 8, 4)} "
                     f"{_cell(out.get('eval_accuracy'), 8, 3)} {_cell(out.get('samples_per_s'), 10, 0)}  {detail}")
    return "\n".join(lines)


class SweepSummary(Callback):
    """Prints the table, and keeps the sweep's MLflow parent run (its jobs' runs become its children)."""

    def __init__(self) -> None:
        self.outcomes: list[dict[str, Any]] = []
        self.parent: Any = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not config.tracking.enabled:
            return
        from hydraddp.tracking.run import SweepRun, preflight
        from hydraddp.tracking.setup import PARENT_RUN_ENV, tracking_uri

        from omegaconf import OmegaConf

        from hydraddp.tracking.names import redact_overrides, secret_paths

        uri = tracking_uri(config)
        if preflight(uri) is None:  # otherwise every job reports the unreachable server itself
            secrets = secret_paths(OmegaConf.to_container(config, resolve=False))
            overrides = redact_overrides(list(config.hydra.overrides.task), secrets)
            self.parent = SweepRun(uri, config.tracking.experiment, overrides)
            os.environ[PARENT_RUN_ENV] = self.parent.run_id

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status == JobStatus.COMPLETED and isinstance(job_return._return_value, dict):
            self.outcomes.append(job_return._return_value)
        else:  # the task itself raised: keep the sweep going, show it as failed
            self.outcomes.append({"status": "failed", "error": repr(job_return._return_value),
                                  "overrides": list(job_return.overrides or [])})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = any(out.get("status") != "ok" for out in self.outcomes)
        if self.parent is not None:
            from hydraddp.tracking.run import FAILED, FINISHED
            from hydraddp.tracking.setup import PARENT_RUN_ENV

            print(f"\nhydraddp sweep: MLflow parent run {self.parent.run_id} at {self.parent.uri}", flush=True)
            self.parent.finish(FAILED if failed else FINISHED, Path(config.hydra.sweep.dir))
            os.environ.pop(PARENT_RUN_ENV, None)
        if self.outcomes:
            print("\nhydraddp sweep summary\n" + summary_table(self.outcomes), flush=True)
        if failed:
            sys.exit(1)
