"""What ``model.pretrained=PATH`` holds, read from the files' headers without loading a tensor: a Hugging Face model
directory or a hydraddp checkpoint, its tensors' shapes and dtypes, and whether they fill a given model. The
preflight and the plan judge PATH by these; the workers load it (``train.pretrained``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from hydraddp.handoff.checkpoints import META, check_readable
from hydraddp.models import fit
from hydraddp.models.hf import HF_CONFIG, PretrainedError


def kind(path: str | Path) -> str:
    """``hf`` (a Hugging Face model directory) or ``checkpoint`` (a hydraddp checkpoint)."""
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
