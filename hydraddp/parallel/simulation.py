"""What the parallel steps do differently while a plan runs them (``hydraddp.distributed.simulated``: torch's fake
process group and fake tensors): the mesh was made before the fake tensors, which cannot make one, and DDP, whose C++
reducer reads real storage, has a stand-in that holds the same bytes (``BucketedGradients``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

world: Any = None  # the simulated world being planned in (it holds ``.mesh``); set by ``simulated_world``


def active() -> Any:
    """The simulated world being planned in, or None in a real one."""
    return world


class BucketedGradients(nn.Module):
    """DDP's memory, where DDP itself cannot run (its C++ reducer reads real storage): communication buckets the
    size of the gradients, made once, and each gradient copied into its bucket as backward produces it. With
    ``gradient_as_bucket_view`` the gradient then *is* its bucket slice, as DDP does it; without, the gradient
    stays and the bucket is a second copy. The all-reduce itself is in place, so it adds nothing."""

    def __init__(self, module: nn.Module, gradient_as_bucket_view: bool = False, **ignored: Any):
        super().__init__()
        self.module = module  # DDP's attribute: parameter names start with "module.", as under DDP
        self._syncing = True
        params = [p for p in module.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        for dtype, group in by_dtype.items():
            bucket = torch.empty(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
            offset = 0
            for param in group:
                view = bucket[offset:offset + param.numel()].view_as(param)
                param.register_post_accumulate_grad_hook(self._copy_into(view, gradient_as_bucket_view))
                offset += param.numel()

    def _copy_into(self, view: torch.Tensor, as_view: bool):
        def hook(param: nn.Parameter) -> None:
            if not self._syncing:
                return
            view.copy_(param.grad)
            if as_view:
                param.grad = view

        return hook

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True
