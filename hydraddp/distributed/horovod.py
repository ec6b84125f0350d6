"""Horovod as a ``Context``. Horovod is optional: everything here imports it lazily."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from hydraddp.distributed.context import Context

HOROVOD = "horovod"
INSTALL_HINT = "install it with `bash scripts/install_horovod.sh` (builds Horovod 0.28.1 with PyTorch and gloo)"


@functools.cache
def has_hvd_support() -> bool:
    """True when ``horovod.torch`` imports. Cached: the import is tried once per process."""
    if importlib.util.find_spec("horovod") is None:
        return False
    try:
        import horovod.torch  # noqa: F401
    except Exception:  # a broken build raises all sorts; any of them means "not usable"
        return False
    return True


def _hvd():
    if not has_hvd_support():
        raise RuntimeError(f"backend='horovod' needs Horovod with PyTorch support: {INSTALL_HINT}")
    import horovod.torch as hvd

    return hvd


class HorovodContext(Context):
    name = "horovod"

    def __init__(self, owns_init: bool):
        self._hvd = _hvd()
        self._owns_init = owns_init
        if torch.cuda.is_available():
            torch.cuda.set_device(self._hvd.local_rank())

    @classmethod
    def create_from_backend(cls, backend: str = HOROVOD, **kwargs: Any) -> HorovodContext:
        hvd = _hvd()
        if hvd.is_initialized():
            raise RuntimeError("Horovod is already initialized; call finalize() first")
        hvd.init(**kwargs)
        return cls(owns_init=True)

    @classmethod
    def create_from_context(cls) -> HorovodContext | None:
        if not has_hvd_support():
            return None
        import horovod.torch as hvd

        return cls(owns_init=False) if hvd.is_initialized() else None

    def rank(self) -> int:
        return self._hvd.rank()

    def local_rank(self) -> int:
        return self._hvd.local_rank()

    def world_size(self) -> int:
        return self._hvd.size()

    def nproc_per_node(self) -> int:
        return self._hvd.local_size()

    def nnodes(self) -> int:
        return self._hvd.cross_size()

    def node_rank(self) -> int:
        return self._hvd.cross_rank()

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def backend(self) -> str:
        return HOROVOD

    def finalize(self) -> None:
        if self._owns_init:
            self._hvd.shutdown()

    def barrier(self) -> None:
        self._hvd.barrier()

    def _do_all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        ops = {"SUM": self._hvd.Sum, "AVERAGE": self._hvd.Average, "MIN": self._hvd.Min, "MAX": self._hvd.Max}
        if op not in ops:
            raise ValueError(f"op={op!r} is not supported by Horovod; use one of {', '.join(ops)}")
        return self._hvd.allreduce(tensor, op=ops[op])

    def _do_all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._hvd.allgather(tensor)

    def _do_all_gather_object(self, obj: Any) -> list[Any]:
        return self._hvd.allgather_object(obj)

    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self._hvd.broadcast(tensor, root_rank=src)

    def _do_broadcast_object(self, obj: Any, src: int) -> Any:
        return self._hvd.broadcast_object(obj, root_rank=src)
