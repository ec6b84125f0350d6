"""One tree-map over the tensors of a batch or a model's output, on torch's pytree.

torch's pytree keeps every container it knows as that container: tuples, lists, dicts, OrderedDicts, namedtuples,
and what registers itself with it (Hugging Face's ``ModelOutput`` does, so ``out.logits`` still works after a cast).
What it sees as a leaf is handled here: a dataclass, field by field; an object that moves itself (Hugging Face's
``BatchEncoding`` has its own ``.to``), by ``moves_itself`` when given; any other mapping, value by value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any], moves_itself: Callable[[Any], Any] | None = None) -> Any:
    """``tree`` rebuilt with ``fn`` applied to every tensor, every container keeping its type."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: map_tensors(getattr(value, f.name), fn, moves_itself)
                                                 for f in dataclasses.fields(value) if f.init})
        if moves_itself is not None and callable(getattr(value, "to", None)):
            return moves_itself(value)
        if isinstance(value, Mapping):
            return {key: map_tensors(item, fn, moves_itself) for key, item in value.items()}
        return value

    return pytree.tree_map(leaf, tree)


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``tree``, depth first."""
    for value in pytree.tree_leaves(tree):
        if isinstance(value, torch.Tensor):
            yield value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                yield from tensors(getattr(value, f.name))
        elif isinstance(value, Mapping):
            yield from tensors(dict(value))


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor of ``tree`` in ``dtype``; other tensors and values as they are."""
    return map_tensors(tree, lambda t: t.to(dtype) if t.is_floating_point() else t)
