"""From a composed config to the launch's MLflow run: URI, tags, redacted config (no mlflow import here)."""

from __future__ import annotations

import os
from typing import Any

from hydraddp.distributed.env import detect_launch_env
from hydraddp import redaction
from hydraddp.tracking import names
from hydraddp.tracking.client import default_uri
from hydraddp.tracking.process import TrackerProcess
from hydraddp.tracking.server import preflight

PARENT_RUN_ENV = "HYDRADDP_PARENT_RUN_ID"  # set by a sweep for its jobs


def tracking_uri(cfg: Any) -> str:
    """The MLflow URI of a config (a DictConfig, or the typed one the preflight judges)."""
    return cfg.tracking.uri or default_uri()


def launch_run(job: Any) -> TrackerProcess:
    """The run of ``job`` (a ``Job``; its tracker process: ``start`` it). Every ``${oc.env:...}`` value and
    every password/token/secret-looking key is masked in the params, the config artifact, the overrides and the
    user's tags."""
    config = job.saved_config
    tags = {
        **config["tracking"]["tags"],
        names.TAG_BACKEND: config["backend"]["name"],
        names.TAG_WRAP: job.wrap,
        names.TAG_PRECISION: config["precision"]["name"],
        names.TAG_OFFLOAD: config["offload"]["name"],
        names.TAG_WORLD_SIZE: str(job.world_size),
        names.TAG_JOB_DIR: str(job.job_dir),
        # What was trained, by class: a sweep over users' models and tasks stays readable in the UI.
        names.TAG_MODEL: str(config["model"].get("_target_", "?")),
        names.TAG_TASK: str(config["task"].get("_target_", "?")),
        **({names.TAG_REQUEUES: str(job.preemptions)} if job.preemptions else {}),
        **({names.TAG_MESH: job.mesh} if job.mesh else {}),
        **({names.TAG_PRETRAINED: str(config["model"]["pretrained"])} if config["model"].get("pretrained") else {}),
    }
    parent = os.environ.get(PARENT_RUN_ENV)
    if parent:
        tags[names.TAG_PARENT] = tags[names.TAG_SWEEP_ID] = parent
    overrides = redaction.redact_overrides(list(job.overrides), job.secret_paths)
    attached = detect_launch_env()
    tracking = job.config["tracking"]
    return TrackerProcess({
        "uri": tracking["uri"] or default_uri(), "experiment": tracking["experiment"], "job_dir": str(job.job_dir),
        "config": config, "overrides": overrides, "tags": tags, "run_id": tracking["run_id"],
        "run_name": _run_name(job, overrides, sweeping=bool(parent)),
        # A resume or a restart continues a run that may hold some of the steps to come: they are not resent.
        "resuming": job.resumes or job.restarted, "resumed_from": job.resumed_from,
        "adopt_run": job.restarted and not tracking["run_id"],
        "entry_point": f"{'torchrun' if attached and attached.source == 'torchrun' else 'python'} -m hydraddp",
    })


def _run_name(job: Any, overrides: list[str], sweeping: bool) -> str:
    """Short and readable: fsdp2-bf16-w8-3f2a from the config's names, or for a sweep's job what the sweep varies
    (ddp-bf16, lr=0.001), from the job's redacted overrides."""
    import json

    tracking = job.config["tracking"]
    fields = names.run_name_fields(job.saved_config, job.wrap, job.world_size, names.experiment_choice(job.overrides))
    fields["swept"] = names.swept_label(overrides, json.loads(os.environ.get(names.SWEPT_KEYS_ENV, "[]")))
    if sweeping and names.run_name(tracking["sweep_run_name"], {**fields, "id": ""}):
        return names.run_name(tracking["sweep_run_name"], fields)
    return names.run_name(tracking["run_name"], fields)


__all__ = ["PARENT_RUN_ENV", "launch_run", "preflight", "tracking_uri"]
