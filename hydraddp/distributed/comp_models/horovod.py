"""Horovod as a computation model. Horovod is optional: everything here imports it lazily.

``has_hvd_support`` is a boolean, as in ignite, but it is computed on first read (PEP 562): importing
``horovod.torch`` takes seconds, and ``import hydraddp`` must stay light.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hydraddp.distributed.comp_models.base import ComputationModel, _is_rank_list
from hydraddp.parallel.machine import rank_device_index

HOROVOD = "horovod"
INSTALL_HINT = "install it with `bash scripts/install_horovod.sh` (builds Horovod 0.28.1 with PyTorch and gloo)"


@functools.cache
def _horovod_loads() -> bool:
    """True when ``horovod.torch`` imports. Cached: the import is tried once per process."""
    if importlib.util.find_spec("horovod") is None:
        return False
    try:
        import horovod.torch  # noqa: F401
    except Exception:  # a broken build raises all sorts; any of them means "not usable"
        return False
    return True


def __getattr__(name: str) -> Any:
    if name == "has_hvd_support":
        return _horovod_loads()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _hvd():
    if not _horovod_loads():
        raise RuntimeError(f"backend='horovod' needs Horovod with PyTorch support: {INSTALL_HINT}")
    import horovod.torch as hvd

    return hvd


def _dynamic_process_sets() -> None:
    # Lets new_group make process sets after init (ignite sets it too); read by hvd.init.
    os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")


class _HorovodDistModel(ComputationModel):
    name = "horovod-dist"
    available_backends = (HOROVOD,)

    def __init__(self, owns_init: bool):
        self._hvd = _hvd()
        self._owns_init = owns_init
        if torch.cuda.is_available():
            torch.cuda.set_device(rank_device_index(self._hvd.local_rank(), torch.cuda.device_count()))

    @staticmethod
    def create_from_backend(backend: str = HOROVOD, comm: Any = None, **kwargs: Any) -> _HorovodDistModel:
        """``hvd.init(comm=comm)``. The native backends' keywords are refused unless unset (``Parallel`` passes
        ``init_method=None``), so a setting that Horovod would ignore is never lost silently."""
        ignored = {k: v for k, v in kwargs.items() if v is not None}
        if ignored:
            raise ValueError(f"backend='horovod' takes only comm=; got {', '.join(sorted(ignored))}")
        if backend != HOROVOD:
            raise ValueError(f"Backend should be one of '{_HorovodDistModel.available_backends}', but given {backend!r}")
        hvd = _hvd()
        if hvd.is_initialized():
            raise RuntimeError("Can not re-initialize Horovod if it is already initialized")
        _dynamic_process_sets()
        hvd.init(comm=comm)
        return _HorovodDistModel(owns_init=True)

    @staticmethod
    def create_from_context() -> _HorovodDistModel | None:
        # Nobody initialized Horovod without importing it; not importing it here keeps the serial path light.
        if "horovod.torch" not in sys.modules or not _horovod_loads():
            return None
        import horovod.torch as hvd

        return _HorovodDistModel(owns_init=False) if hvd.is_initialized() else None

    @staticmethod
    def spawn(fn: Callable, args: tuple, kwargs_dict: Mapping | None = None, nproc_per_node: int = 1,
              hosts: str | None = None, backend: str = HOROVOD, **kwargs: Any) -> dict[int, Any]:
        """Start ``nproc_per_node`` workers through Horovod's own runner (gloo controller), as horovodrun would."""
        from hydraddp.distributed import elastic

        if kwargs.pop("nnodes", 1) > 1 or kwargs.pop("node_rank", 0) > 0:
            raise RuntimeError("For multi-node configuration, please set 'hosts' argument instead according "
                               "to horovod.run API.")
        if kwargs.pop("max_restarts", 0):
            raise ValueError("Horovod's runner does not restart workers: max_restarts needs a native backend "
                             "(gloo, nccl); use max_restarts=0 with backend='horovod'")
        for name in ("master_addr", "master_port", "init_method", "start_method", "rdzv_endpoint", "rdzv_timeout",
                     "run_id", "log_dir", "tee", "monitor_interval", "join", "daemon"):
            kwargs.pop(name, None)  # the elastic agent's options: Horovod's runner has its own rendezvous
        _dynamic_process_sets()
        return elastic.launch_horovod(_HorovodDistModel, HOROVOD, fn, args, dict(kwargs_dict or {}), nproc_per_node,
                                      hosts=hosts, **kwargs)

    def get_rank(self) -> int:
        return self._hvd.rank()

    def get_local_rank(self) -> int:
        return self._hvd.local_rank()

    def get_world_size(self) -> int:
        return self._hvd.size()

    def get_nproc_per_node(self) -> int:
        return self._hvd.local_size()

    def get_nnodes(self) -> int:
        return self._hvd.cross_size()

    def get_node_rank(self) -> int:
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
        self._hvd.allreduce(torch.tensor(0, device="cpu"), name="barrier")

    def _setup_group(self, group: Any) -> Any:
        if _is_rank_list(group):
            group = self._do_new_group(group)
        if not isinstance(group, self._hvd.ProcessSet):
            raise ValueError(f"Argument group should be list of int or hvd.ProcessSet, got {type(group)}, group={group}")
        return group

    def _do_all_reduce(self, tensor: torch.Tensor, op: str = "SUM", group: Any | None = None) -> torch.Tensor:
        if group is not None:
            raise NotImplementedError("all_reduce with group for horovod is not implemented")
        ops = {"SUM": self._hvd.Sum, "AVERAGE": self._hvd.Average}
        if op in ops:
            return self._hvd.allreduce(tensor, op=ops[op])
        # Horovod has no MIN/MAX/PRODUCT: gather (one row per rank) and reduce here.
        manual = {"MIN": torch.amin, "MAX": torch.amax, "PRODUCT": torch.prod}
        if op not in manual:
            raise ValueError(f"Unsupported reduction operation: '{op}'")
        return manual[op](self._hvd.allgather(tensor.unsqueeze(0)), dim=0)

    def _do_all_gather(self, tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor:
        group = None if group is None else self._setup_group(group)
        if self._rank_not_in_group(group):
            return tensor
        if tensor.dim() == 0:
            tensor = tensor.unsqueeze(0)
        return self._hvd.allgather(tensor) if group is None else self._hvd.allgather(tensor, process_set=group)

    def _do_all_gather_object(self, obj: Any, group: Any | None = None) -> list[Any]:
        if group is not None:
            raise NotImplementedError("all_gather with group for horovod is not implemented")
        # Horovod names an object collective after the object's type unless told: ranks passing different types
        # (the source's value, None elsewhere) would wait on different names forever.
        return self._hvd.allgather_object(obj, name="hydraddp.all_gather_object")

    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self._hvd.broadcast(tensor, root_rank=src)

    def _do_broadcast_object(self, obj: Any, src: int) -> Any:
        return self._hvd.broadcast_object(obj, root_rank=src, name="hydraddp.broadcast_object")

    def _do_new_group(self, ranks: list[int], **kwargs: Any) -> Any:
        return self._hvd.add_process_set(ranks)

    def _rank_not_in_group(self, group: Any | None) -> bool:
        return group is not None and not group.included()


def accept_set_to_none(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Give a ``hvd.DistributedOptimizer`` torch's ``zero_grad(set_to_none=True)`` signature, in place.

    Horovod 0.28.1's ``zero_grad(self)`` takes no argument, yet torch.distributed.checkpoint's optimizer state dict
    calls ``zero_grad(set_to_none=True)`` (a resume, or saving a stateless optimizer) and raised a TypeError.
    Horovod's own check, no zeroing while allreduces are pending, still runs first.
    """
    cls = type(optimizer)  # Horovod makes a new class per wrapped optimizer, so patching it touches no other
    horovod_zero_grad = cls.__dict__["zero_grad"]

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        if self._handles:
            horovod_zero_grad(self)  # raises Horovod's AssertionError: zeroing now would race the allreduces
        super(cls, self).zero_grad(set_to_none=set_to_none)

    cls.zero_grad = zero_grad
    return optimizer
