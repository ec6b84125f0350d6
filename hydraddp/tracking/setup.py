"""From a composed config to the launch's MLflow run: URI, tags, redacted config (no mlflow import here)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hydraddp.tracking import names
from hydraddp.tracking.process import TrackerProcess
from hydraddp.tracking.run import default_uri, preflight

PARENT_RUN_ENV = "HYDRADDP_PARENT_RUN_ID"  # set by a sweep for its jobs


def tracking_uri(cfg: DictConfig) -> str:
    return cfg.tracking.uri or default_uri()


def launch_run(cfg: DictConfig, resolved: dict[str, Any], job_dir: Path, overrides: list[str],
               realized_wrap: str, world_size: int, resumed_from: dict[str, Any] | None = None,
               restarted: bool = False, extra_tags: dict[str, str] | None = None) -> TrackerProcess:
    """The launch's run (its tracker process; ``start`` it). Every ``${oc.env:...}`` value and every password/token/secret-looking key is masked
    in the params, the config artifact, the overrides and the user's tags."""
    secrets = names.secret_paths(OmegaConf.to_container(cfg, resolve=False))
    config = names.redact(resolved, secrets)
    tags = {
        **config["tracking"]["tags"],
        names.TAG_BACKEND: resolved["backend"]["name"],
        names.TAG_WRAP: realized_wrap,
        names.TAG_PRECISION: cfg.precision.name,
        names.TAG_OFFLOAD: cfg.offload.name,
        names.TAG_WORLD_SIZE: str(world_size),
        # What was trained, by class: a sweep over users' models and tasks stays readable in the UI.
        names.TAG_MODEL: str(resolved["model"].get("_target_", "?")),
        names.TAG_TASK: str(resolved["task"].get("_target_", "?")),
        **(extra_tags or {}),
    }
    parent = os.environ.get(PARENT_RUN_ENV)
    if parent:
        tags[names.TAG_PARENT] = parent
    overrides = names.redact_overrides(overrides, secrets)
    return TrackerProcess({
        "uri": tracking_uri(cfg), "experiment": cfg.tracking.experiment, "job_dir": str(job_dir), "config": config,
        "overrides": overrides, "tags": tags, "run_id": cfg.tracking.run_id, "run_name": " ".join(overrides) or None,
        # A resume or a restart continues a run that may hold some of the steps to come: they are not resent.
        "resuming": bool(cfg.checkpoint.resume) or restarted, "resumed_from": resumed_from,
        "adopt_run": restarted and not cfg.tracking.run_id,
    })


__all__ = ["PARENT_RUN_ENV", "launch_run", "preflight", "tracking_uri"]
