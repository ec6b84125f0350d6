"""A checkpoint's model, whatever wrap mode and world size wrote it, in a format the ecosystem loads (``python -m
hydraddp.export`` and a run's LoggedModel write them).

- ``pt``: one plain state_dict file, which loads with ``torch.load(OUT, weights_only=True)`` into the unwrapped model
  the checkpoint was saved from (``models.of_config.recorded_model``: its config's sizes and its transformers config).
- ``hf``: a Hugging Face model directory (``config.json``, ``generation_config.json`` and safetensors, sharded above
  ``max_shard_mb`` with a ``model.safetensors.index.json``) that ``AutoModelForCausalLM.from_pretrained(OUT)`` loads;
  a transformers model's checkpoints only. The tensors are read from the DCP checkpoint one output file at a time:
  this process holds at most one file's tensors, never the whole model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hydraddp.parallel.wrappers import size_buckets
from hydraddp.models import fit
from hydraddp.models.hf import HF_TARGET, config_from_dict
from hydraddp.models.of_config import recorded_model
from hydraddp.handoff.checkpoints import CheckpointError, check_matches, read_meta
from hydraddp.handoff.dcp_index import reader


FORMATS = ("pt", "hf")
MAX_SHARD_MB = 5000  # transformers' own default shard size (5 GB)
HF_INDEX = "model.safetensors.index.json"


def export(checkpoint: Path, out: Path, format: str = "pt", max_shard_mb: float = MAX_SHARD_MB) -> Path:
    if not checkpoint.exists():
        raise CheckpointError(f"{checkpoint}: no such checkpoint. Give a step_NNNNNNNN directory of a run's "
                              "checkpoints (e.g. outputs/DATE/TIME/checkpoints/step_00000100).")
    meta = read_meta(checkpoint)
    if format == "hf":
        return export_hf(checkpoint, out, meta, int(max_shard_mb * 1e6))
    model = recorded_model(meta, "cpu")  # the model the checkpoint was saved from: its sizes, its HF config
    state = {"model": model.state_dict()}
    check_matches(checkpoint, state)
    _load_model_keys(checkpoint, state)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state["model"], out)
    return out


def _load_model_keys(checkpoint: Path, state: dict) -> None:
    """Fill ``state`` (``{"model": {key: tensor}}``) from the checkpoint: only those keys are read."""
    with warnings.catch_warnings():
        # One process reading a checkpoint is what no_dist means; DCP still warns that no group exists.
        warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
        dcp.load(state, storage_reader=reader(checkpoint), no_dist=True)


def export_hf(checkpoint: Path, out: Path, meta: dict, max_shard_bytes: int) -> Path:
    """The checkpoint as a Hugging Face model directory, written one safetensors file at a time."""
    import transformers
    from safetensors.torch import save_file

    from hydraddp.handoff.pretrained import stored_tensors

    config = _transformers_config(checkpoint, meta)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    check_matches(checkpoint, {"model": state})
    tied = fit.tied_keys(model)
    # A tied tensor is stored once, under its first key (as save_pretrained does); from_pretrained ties it again.
    keys = [k for k in state if k not in tied or tied[k][0] == k]
    stored = {k: v for k, v in stored_tensors(checkpoint, "checkpoint").items() if k in keys}
    nbytes = {k: stored[k].size.numel() * stored[k].properties.dtype.itemsize for k in keys}
    files = size_buckets(keys, nbytes.__getitem__, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for number, shard_keys in enumerate(files, 1):
        name = "model.safetensors" if len(files) == 1 else f"model-{number:05d}-of-{len(files):05d}.safetensors"
        tensors = {"model": {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in shard_keys}}
        _load_model_keys(checkpoint, tensors)
        save_file(tensors["model"], str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_keys, name))
        del tensors  # before the next file's: one file's tensors at a time
    if len(files) > 1:
        total = sum(nbytes.values())
        (out / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(str(out))
    if model.can_generate():
        transformers.GenerationConfig.from_model_config(config).save_pretrained(str(out))
    return out


def _transformers_config(checkpoint: Path, meta: dict) -> Any:
    """The transformers config the checkpoint's model was built with. A model of another kind cannot be written in
    Hugging Face's format."""
    model_cfg = meta["config"]["model"]
    if model_cfg.get("_target_") != HF_TARGET:
        raise CheckpointError(f"{checkpoint}: --format hf writes a transformers model (model=hf_causal_lm); this "
                              f"checkpoint's model is {model_cfg.get('_target_')}. Use --format pt.")
    saved = meta.get("hf_config")
    return config_from_dict(saved) if saved is not None else recorded_model(meta).config
