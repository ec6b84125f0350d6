"""The trained model for MLflow's LoggedModel, rank side: every rank consolidates, the tracking rank saves, the
tracker logs (``hydraddp.tracking.logged_model``; no mlflow here).

``record_model`` is a collective. Up to ``tracking.model.max_copy_mb`` (MB: 10^6 bytes) the full, unwrapped state
dict is gathered whatever the wrap and written with one input example into ``<job dir>/model/step_NNNNNNNN/``;
above it nothing is gathered: the LoggedModel refers to the DCP checkpoint of that step (written now if it is not
yet). Either way the tracking rank writes a ``model`` event with what the tracker needs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

import hydraddp.distributed as idist
from hydraddp.tracking.events import EventWriter
from hydraddp.handoff import checkpoints
from hydraddp.models.hf import HF_TARGET, config_dict
from hydraddp.train import pipelined

log = logging.getLogger("hydraddp.train.loop")
MODEL_DIR = "model"  # in the job directory
STATE_FILE, EXAMPLE_FILE = "state_dict.pt", "input_example.pt"
EXAMPLE_ROWS = 4  # of the last batch: enough to show the shape, small in the MLmodel
MB = 10**6


def model_folder(job_dir: Path, step: int) -> Path:
    return Path(job_dir, MODEL_DIR, f"step_{step:08d}")


def full_bytes(model: nn.Module) -> int:
    """The size of the whole model's parameters at rest, the same on every rank whatever the wrap (auto_model
    counted them before sharding)."""
    if isinstance(model, pipelined.Forward):
        return model.whole_bytes()
    record = getattr(model, "_hydraddp_wrap", None)
    if record is not None:
        return record.total_numel * record.precision.storage_dtype.itemsize
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor counts its global size


def full_state_dict(model: nn.Module, keep: bool, on_rank0: bool) -> dict[str, torch.Tensor] | None:
    """The unwrapped model's full state dict on the CPU where ``keep``, else None. Under a process group it is a
    collective (FSDP gathers its shards); ``on_rank0`` (the keeper is rank 0) lets the other ranks skip the copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if isinstance(model, pipelined.Forward):
        return model.whole_state_dict(lambda stage: full_state_dict(stage, True, on_rank0=False), keep)
    module = model.module if isinstance(model, nn.DataParallel) else model  # DCP knows DDP's and FSDP's names only
    grouped = dist.is_available() and dist.is_initialized()
    if not grouped and not keep:
        return None  # Horovod or one process: each rank holds the whole model, nothing to take part in
    # Under a process group cpu_offload also means "rank 0 only": another keeper gathers on its device instead. On
    # the CPU FSDP1 would free the very storage it "moved" there (its to_cpu is then a no-op): every rank gathers.
    offload = not grouped or (on_rank0 and idist.device().type != "cpu")
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    return {k: v.detach().cpu() for k, v in state.items()} if keep else None


def input_example(batch: Any, rows: int = EXAMPLE_ROWS) -> torch.Tensor | None:
    """The first rows of what the model takes positionally, on the CPU: the inputs of an ``(inputs, targets)``
    batch, or a dict batch's ``input_ids``. None for anything else (MLflow's torch flavor feeds one tensor)."""
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    elif isinstance(batch, Mapping):
        batch = batch.get("input_ids")
    return batch[:rows].detach().cpu().clone() if isinstance(batch, torch.Tensor) and batch.dim() else None


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # the tracker never reads a half-written file


def _write_copy(folder: Path, state: dict[str, torch.Tensor], example: torch.Tensor | None) -> dict[str, str]:
    """The state dict and the input example in ``folder``: their paths, for the tracker."""
    folder.mkdir(parents=True, exist_ok=True)
    _save(state, folder / STATE_FILE)
    if example is None:
        return {"state_dict": str(folder / STATE_FILE)}
    _save(example, folder / EXAMPLE_FILE)
    return {"state_dict": str(folder / STATE_FILE), "input_example": str(folder / EXAMPLE_FILE)}


def _hf_export(checkpoint: Path, folder: Path, max_shard_mb: float) -> str | None:
    """``python -m hydraddp.export CHECKPOINT folder/hf --format hf``, in files of at most ``max_shard_mb`` (this
    process holds one at a time); None, with a warning, when it cannot be written."""
    from hydraddp.train.formats import export

    try:
        return str(export(Path(checkpoint), folder / "hf", "hf", max_shard_mb))
    except (OSError, ValueError) as exc:
        log.warning("the model of %s is not exported to Hugging Face's format: %s", checkpoint, exc)
        return None


def record_model(cfg: DictConfig, model: nn.Module, batch: Any, step: int, events: EventWriter | None,
                 job_dir: Path | None, saver: Any) -> None:
    """The model of ``step`` for the run's LoggedModel; every rank calls it.

    ``batch``: this launch's last training batch (for the input example), None when it took no step.
    ``saver``: the launch's ``resume.Saver``, which writes the checkpoint a large model's LoggedModel refers to.
    """
    keeps = events is not None and job_dir is not None
    keepers = idist.all_gather(int(keeps)) if idist.get_world_size() > 1 else [int(keeps)]
    if 1 not in keepers:
        return  # no rank writes events (train() called without a tracker)
    size = full_bytes(model)
    if size > cfg.tracking.model.max_copy_mb * MB:
        checkpoint = saver.save(step)  # a collective; the one already written when this step was saved
        if not keeps:
            return
        if checkpoint is None:
            log.warning("the model of step %d (%.0f MB, above tracking.model.max_copy_mb=%s) is not logged: no "
                        "checkpoint root to refer to", step, size / MB, cfg.tracking.model.max_copy_mb)
            return
        # The LoggedModel names this checkpoint: keep_last must never prune it away.
        checkpoints.pin(checkpoint, f"the LoggedModel of step {step}")
        where = {"checkpoint": str(checkpoint)}
        if cfg.model.get("_target_") == HF_TARGET:  # a transformers model: also in the format transformers loads
            where["hf_export"] = _hf_export(checkpoint, model_folder(job_dir, step), cfg.tracking.model.max_copy_mb)
    else:
        state = full_state_dict(model, keeps, on_rank0=keepers.index(1) == 0)
        if not keeps:
            return
        try:
            where = _write_copy(model_folder(job_dir, step), state, input_example(batch))
        except OSError as exc:  # a full disk costs the run its model, not the training it finished
            log.warning("the model of step %d is not logged: %s", step, exc)
            return
    folder = model_folder(job_dir, step)
    folder.mkdir(parents=True, exist_ok=True)  # the tracker keeps its progress there
    # The model's config as checkpoints keep it (secrets redacted): what the tracker builds the bare model from.
    events.record("model", {"step": step, "target": cfg.model.get("_target_"), "size_bytes": size,
                            "folder": str(folder), "model_config": saver.saved_config["model"],
                            "hf_config": config_dict(model), **where})
