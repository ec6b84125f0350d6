"""``model.pretrained=PATH``: a run that starts from trained weights, streamed from storage into each rank's shards.

PATH is either
- a Hugging Face model directory (``config.json`` and ``*.safetensors``, one file or sharded with an index), for a
  transformers model (``model=hf_causal_lm``). Its ``config.json`` is the architecture: the launch takes the model's
  sizes from it (``models.hf.from_hf_config``), and a size typed on the command line that contradicts it is refused. The tensors
  are read by DCP's ``HuggingFaceStorageReader``, each rank only the slices its shards hold, and cast into the model's
  dtype (a bf16 file into fp32 master weights);
- a hydraddp checkpoint (``step_NNNNNNNN``), for any model: its weights only. The optimizer starts fresh at step 0,
  in a new MLflow run tagged ``hydraddp.pretrained``.

The launch checks PATH against the model of the config (``models.of_config``), on the meta device, before any worker
starts (``preflight.model.model_problems``, with ``mismatch``); the workers load it after wrapping (``load``), where a
resume would have loaded a checkpoint instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from hydraddp.models import fit
from hydraddp.models.hf import HF_CONFIG, PretrainedError

__all__ = ["PretrainedError", "kind", "load", "mismatch", "stored_dtypes"]


def kind(path: str | Path) -> str:
    """``hf`` (a Hugging Face model directory) or ``checkpoint`` (a hydraddp checkpoint)."""
    from hydraddp.train.checkpoint import META

    path = Path(path)
    if not path.exists():
        raise PretrainedError(f"model.pretrained={path}: no such file or directory. Give a Hugging Face model "
                              "directory (config.json and *.safetensors) or a hydraddp checkpoint (step_NNNNNNNN).")
    if (path / HF_CONFIG).is_file():
        return "hf"
    if (path / META).is_file():
        return "checkpoint"
    raise PretrainedError(f"model.pretrained={path}: neither a Hugging Face model directory (no {HF_CONFIG}) nor a "
                          f"hydraddp checkpoint (no {META}).")


def stored_tensors(path: Path, source: str) -> dict[str, Any]:
    """DCP's metadata of each tensor ``path`` holds, by the model's state_dict key (read from the files' headers)."""
    if source == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        return dict(HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata)
    from hydraddp.train.checkpoint import check_readable

    return {key.removeprefix("model."): value for key, value in check_readable(path).items()
            if key.startswith("model.") and hasattr(value, "size")}


def expected_keys(path: Path, source: str) -> dict[str, tuple[int, ...]]:
    """The tensors ``path`` holds, by the model's state_dict key, with their shapes."""
    return {key: tuple(value.size) for key, value in stored_tensors(Path(path), source).items()}


def stored_dtypes(path: str | Path, source: str) -> list[Any]:
    """The dtype of each tensor ``path`` holds."""
    return [value.properties.dtype for value in stored_tensors(Path(path), source).values()]


def mismatch(path: Path, source: str, model: nn.Module) -> str | None:
    """What stops ``path`` from filling ``model`` (built whole or on the meta device); None when it fits."""
    return fit.mismatch(expected_keys(path, source), fit.shapes(model.state_dict()), fit.tied_keys(model))


def load(path: str | Path, model: nn.Module) -> None:
    """Fill ``model`` (wrapped: DDP, FSDP1, FSDP2 or none) from ``path``, each rank reading the parts its own tensors
    hold. A collective under a process group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from hydraddp.train.checkpoint import reader

    path = Path(path)
    source = kind(path)
    state = get_model_state_dict(model)  # templates, sharded as this run shards them
    stored = expected_keys(path, source)
    # A tied key the file leaves out (lm_head.weight beside embed_tokens.weight) is filled through its alias.
    state = {k: v for k, v in state.items() if k in stored}
    distributed = dist.is_available() and dist.is_initialized()
    if source == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=not distributed)
    else:
        wrapped = {"model": state}
        dcp.load(wrapped, storage_reader=reader(path), no_dist=not distributed)
        state = wrapped["model"]
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))  # the tied aliases left out above
