"""The training loop that every rank runs."""

from __future__ import annotations

from typing import Any

__all__ = ["TrainResult", "train"]


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): the launcher reads preemption markers from here before it may import torch.
    if name in __all__:
        from hydraddp.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'hydraddp.train' has no attribute {name!r}")
