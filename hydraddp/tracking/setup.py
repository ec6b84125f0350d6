"""From a composed config to the launch's MLflow run: URI, tags, redacted config (no mlflow import here)."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from hydraddp.distributed.env import detect_launch_env
from hydraddp import redaction
from hydraddp.tracking import names
from hydraddp.tracking.client import default_uri
from hydraddp.tracking.process import TrackerProcess
from hydraddp.tracking.run import preflight

PARENT_RUN_ENV = "HYDRADDP_PARENT_RUN_ID"  # set by a sweep for its jobs


def tracking_uri(cfg: DictConfig) -> str:
    return cfg.tracking.uri or default_uri()


def launch_run(plan: Any) -> TrackerProcess:
    """The run of ``plan`` (a ``LaunchPlan``; its tracker process: ``start`` it). Every ``${oc.env:...}`` value and
    every password/token/secret-looking key is masked in the params, the config artifact, the overrides and the
    user's tags."""
    config = plan.saved_config
    tags = {
        **config["tracking"]["tags"],
        names.TAG_BACKEND: config["backend"]["name"],
        names.TAG_WRAP: plan.wrap,
        names.TAG_PRECISION: config["precision"]["name"],
        names.TAG_OFFLOAD: config["offload"]["name"],
        names.TAG_WORLD_SIZE: str(plan.world_size),
        names.TAG_JOB_DIR: str(plan.job_dir),
        # What was trained, by class: a sweep over users' models and tasks stays readable in the UI.
        names.TAG_MODEL: str(config["model"].get("_target_", "?")),
        names.TAG_TASK: str(config["task"].get("_target_", "?")),
        **({names.TAG_REQUEUES: str(plan.preemptions)} if plan.preemptions else {}),
        **({names.TAG_MESH: plan.mesh} if plan.mesh else {}),
        **({names.TAG_PRETRAINED: str(config["model"]["pretrained"])} if config["model"].get("pretrained") else {}),
    }
    parent = os.environ.get(PARENT_RUN_ENV)
    if parent:
        tags[names.TAG_PARENT] = tags[names.TAG_SWEEP_ID] = parent
    overrides = redaction.redact_overrides(list(plan.overrides), plan.secret_paths)
    attached = detect_launch_env()
    tracking = plan.config["tracking"]
    return TrackerProcess({
        "uri": tracking["uri"] or default_uri(), "experiment": tracking["experiment"], "job_dir": str(plan.job_dir),
        "config": config, "overrides": overrides, "tags": tags, "run_id": tracking["run_id"],
        "run_name": _run_name(plan, overrides, sweeping=bool(parent)),
        # A resume or a restart continues a run that may hold some of the steps to come: they are not resent.
        "resuming": plan.resumes or plan.restarted, "resumed_from": plan.resumed_from,
        "adopt_run": plan.restarted and not tracking["run_id"],
        "entry_point": f"{'torchrun' if attached and attached.source == 'torchrun' else 'python'} -m hydraddp",
    })


def _run_name(plan: Any, overrides: list[str], sweeping: bool) -> str:
    """Short and readable: fsdp2-bf16-w8-3f2a from the config's names, or for a sweep's job what the sweep varies
    (ddp-bf16, lr=0.001), from the job's redacted overrides."""
    import json

    tracking = plan.config["tracking"]
    fields = names.run_name_fields(plan.saved_config, plan.wrap, plan.world_size, names.experiment_choice(plan.overrides))
    fields["swept"] = names.swept_label(overrides, json.loads(os.environ.get(names.SWEPT_KEYS_ENV, "[]")))
    if sweeping and names.run_name(tracking["sweep_run_name"], {**fields, "id": ""}):
        return names.run_name(tracking["sweep_run_name"], fields)
    return names.run_name(tracking["run_name"], fields)


__all__ = ["PARENT_RUN_ENV", "launch_run", "preflight", "tracking_uri"]
