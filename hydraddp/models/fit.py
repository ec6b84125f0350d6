"""Whether stored tensors fit a model: the one check a resume's checkpoint, ``model.pretrained`` and ``export`` share.
Keys are compared both ways, then shapes; a tied tensor (one tensor under several keys) is found under any of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from hydraddp.parallel.meta_init import shared_tensors

Shapes = Mapping[str, Sequence[int]]


def tied_keys(model: nn.Module) -> dict[str, list[str]]:
    """Each state_dict key of a tensor that several keys share (tied embeddings) -> all of its keys, in the state
    dict's order (the meta build's own detection, ``meta_init.shared_tensors``, read as state_dict keys)."""
    keys = set(model.state_dict(keep_vars=True))
    tied: dict[str, list[str]] = {}
    for names in shared_tensors(model).values():
        group = [name for name in dict.fromkeys(names) if name in keys]
        if len(group) > 1:
            tied.update(dict.fromkeys(group, group))
    return tied


def shapes(state: Mapping[str, object]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a state dict (anything with ``.shape``)."""
    return {key: tuple(value.shape) for key, value in state.items() if hasattr(value, "shape")}


def mismatch(stored: Shapes, wanted: Shapes, tied: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """What keeps ``stored`` (key -> shape, what a file holds) from filling ``wanted`` (the model's): missing or
    unexpected keys, the first of each named, else the first shape that differs; None when it fits."""
    tied = tied or {}
    missing = sorted(k for k in wanted if k not in stored and not any(a in stored for a in tied.get(k, ())))
    unexpected = sorted(k for k in stored if k not in wanted)
    if missing or unexpected:
        return f"missing {_first(missing)}, unexpected {_first(unexpected)}"
    for key, shape in stored.items():
        if tuple(wanted[key]) != tuple(shape):
            return f"{key} has shape {tuple(shape)} there but {tuple(wanted[key])} in this model"
    return None


def _first(keys: list[str], shown: int = 3) -> str:
    return f"{keys[:shown]}{' ...' if len(keys) > shown else ''} ({len(keys)})"
