"""The functional API: ignite 0.5.5's ``idist`` names and semantics, all reading one computation model.

The model is set by ``initialize``/``spawn``/``Parallel`` and held in ``context``. While it is the serial one and
nobody pinned it, each call looks for a process group someone else started (torchrun script, user code, Horovod) and
adopts it, as ignite's ``sync`` does. ``current()`` is that one place; ``_model`` (ignite's private name, read by
ignite's own tests) is a read-only view of it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import wraps
from typing import Any

import torch
import torch.nn.functional as F

from hydraddp.distributed import context
from hydraddp.distributed.comp_models import registered_computation_models
from hydraddp.distributed.comp_models.base import ComputationModel, _is_rank_list, _SerialModel
from hydraddp.distributed.comp_models.horovod import HOROVOD, _horovod_loads, _HorovodDistModel
from hydraddp.distributed.comp_models.native import (NATIVE_BACKENDS, _NativeDistModel, has_native_dist_support,
                                                     native_backends_available)
from hydraddp.distributed.comp_models.xla import NOT_SUPPORTED as XLA_NOT_SUPPORTED
from hydraddp.distributed.comp_models.xla import XLA_TPU, has_xla_support
from hydraddp.distributed.context import finalize

__all__ = [
    "backend", "broadcast", "device", "available_backends", "model_name", "get_world_size", "get_rank",
    "get_local_rank", "get_nproc_per_node", "get_node_rank", "get_nnodes", "spawn", "initialize", "finalize",
    "show_config", "set_local_rank", "all_reduce", "all_gather", "barrier", "hostname", "has_xla_support",
    "has_native_dist_support", "has_hvd_support", "sync", "registered_computation_models", "one_rank_only",
    "new_group", "one_rank_first", "all_gather_tensors_with_shapes",
]

def __getattr__(name: str) -> Any:
    if name == "_model":
        return current()
    if name == "has_hvd_support":  # computed on first read: it imports Horovod
        return _horovod_loads()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_set_model = context.set_model  # ignite's private name, which ignite's own tests call


def sync(temporary: bool = False) -> None:
    """Adopt the distributed context that exists now (a process group, Horovod), or the serial model."""
    for model_cls in registered_computation_models:
        if model_cls is _SerialModel:
            continue
        model = model_cls.create_from_context()
        if model is not None:
            _set_model(model, temporary=temporary)
            return
    _set_model(_SerialModel())


def current() -> ComputationModel:
    """The computation model every function here reads."""
    if context.looking_for_context():
        sync(temporary=True)
    return context.model()


def is_available(backend: str) -> bool:
    """Whether ``backend`` runs here; Horovod is imported only when it is the one asked about."""
    return backend in native_backends_available() or (backend == HOROVOD and _horovod_loads())


def _assert_backend(backend: str) -> None:
    if backend == XLA_TPU:
        raise ValueError(XLA_NOT_SUPPORTED)
    if not is_available(backend):
        raise ValueError(f"Backend should be one of '{available_backends()}', but given {backend!r}")


def available_backends() -> tuple[str, ...]:
    return native_backends_available() + ((HOROVOD,) if _horovod_loads() else ())


def model_name() -> str:
    """``serial``, ``native-dist`` or ``horovod-dist``."""
    return current().name


def initialize(backend: str, **kwargs: Any) -> None:
    """Start the distributed context for ``backend`` (``nccl``, ``gloo``, ``mpi`` or ``horovod``).

    Rank and world size come from the launcher's environment (torchrun, SLURM, mpirun, horovodrun). For the native
    backends ``kwargs`` are ``timeout``, ``init_method`` (default ``env://``), ``rank``, ``world_size`` and anything
    else ``torch.distributed.init_process_group`` takes; for Horovod, ``hvd.init``'s.

    >>> import hydraddp.distributed as idist
    >>> idist.initialize("gloo")  # doctest: +SKIP
    """
    context.raise_if_active()
    if backend == XLA_TPU:
        raise ValueError(XLA_NOT_SUPPORTED)
    if backend in NATIVE_BACKENDS:
        context.start(_NativeDistModel, backend, **kwargs)
    elif backend == HOROVOD:
        context.start(_HorovodDistModel, backend, **kwargs)
    else:
        raise ValueError(f"Backend should be one of '{available_backends()}', but given {backend!r}")


def spawn(backend: str, fn: Callable, args: tuple, kwargs_dict: Mapping | None = None, nproc_per_node: int = 1,
          **kwargs: Any) -> dict[int, Any]:
    """Start ``nproc_per_node`` processes that each initialize ``backend`` and run
    ``fn(local_rank, *args, **kwargs_dict)``. ``kwargs``: ``nnodes``, ``node_rank``, ``master_addr``,
    ``master_port``, ``init_method``, ``timeout``, ``start_method`` and ``elastic.launch``'s options.
    Returns ``{global_rank: fn's return value}`` for this node's ranks (ignite returns None)."""
    _assert_backend(backend)
    model_cls = _HorovodDistModel if backend == HOROVOD else _NativeDistModel
    return model_cls.spawn(fn, args=args, kwargs_dict=kwargs_dict or {}, nproc_per_node=nproc_per_node,
                           backend=backend, **kwargs)


def get_rank() -> int:
    return current().get_rank()


def get_local_rank() -> int:
    return current().get_local_rank()


def get_world_size() -> int:
    return current().get_world_size()


def get_nproc_per_node() -> int:
    return current().get_nproc_per_node()


def get_nnodes() -> int:
    return current().get_nnodes()


def get_node_rank() -> int:
    return current().get_node_rank()


def device() -> torch.device:
    return current().device()


def backend() -> str | None:
    return current().backend()


def hostname() -> str:
    return socket.gethostname()


def set_local_rank(index: int) -> None:
    """Tell hydraddp this process's local rank when you start the process group yourself without LOCAL_RANK."""
    ComputationModel._ext_local_rank = index


def barrier() -> None:
    current().barrier()


def all_reduce(tensor: torch.Tensor | float, op: str = "SUM", group: Any | list[int] | None = None) -> Any:
    return current().all_reduce(tensor, op, group=group)


def all_gather(tensor: Any, group: Any | list[int] | None = None) -> Any:
    return current().all_gather(tensor, group=group)


def broadcast(tensor: Any, src: int = 0, safe_mode: bool = False) -> Any:
    return current().broadcast(tensor, src=src, safe_mode=safe_mode)


def new_group(ranks: list[int], **kwargs: Any) -> Any:
    """A group of ``ranks`` for the collectives' ``group=``: a ProcessGroup (native), a process set (Horovod),
    the list itself (serial)."""
    return current().new_group(ranks, **kwargs)


def _rank_not_in_group(group: Any) -> bool:
    return False if group is None else current()._rank_not_in_group(group)


def all_gather_tensors_with_shapes(tensor: torch.Tensor, shapes: Sequence[Sequence[int]],
                                   group: Any | list[int] | None = None) -> list[torch.Tensor]:
    """Gather tensors of different shapes (same number of dims); ``shapes[i]`` is rank i's (in ``group``).
    Each is padded to the largest shape, gathered, and cut back."""
    model = current()
    if _is_rank_list(group):
        group = model.new_group(group)
    if _rank_not_in_group(group):
        return [tensor]
    max_shape = torch.tensor(shapes).amax(dim=0)
    padding = (max_shape - torch.tensor(tensor.shape)).tolist()
    pad = [size for dim_pad in reversed(padding) for size in (0, dim_pad)]
    gathered = model.all_gather(F.pad(tensor, pad), group=group)
    rows = int(max_shape[0])
    return [gathered[tuple(slice(i * rows, i * rows + size) if dim == 0 else slice(0, size)
                           for dim, size in enumerate(shape))]
            for i, shape in enumerate(shapes)]


def _setup_logger(name: str) -> logging.Logger:
    """ignite's ``setup_logger``: INFO to stderr on rank 0, nothing on the other ranks, not propagated."""
    logger = logging.getLogger(name)
    existing = bool(logger.handlers)
    if get_rank() > 0:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.addHandler(logging.NullHandler())
    elif not existing:
        logger.setLevel(logging.INFO)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    logger.propagate = False
    return logger


def show_config() -> None:
    """Log the distributed configuration (rank 0 only)."""
    logger = _setup_logger(__name__)
    logger.info(f"distributed configuration: {model_name()}")
    logger.info(f"backend: {backend()}")
    logger.info(f"device: {device().type}")
    logger.info(f"hostname: {hostname()}")
    logger.info(f"world size: {get_world_size()}")
    logger.info(f"rank: {get_rank()}")
    logger.info(f"local rank: {get_local_rank()}")
    logger.info(f"num processes per_node: {get_nproc_per_node()}")
    logger.info(f"num nodes: {get_nnodes()}")
    logger.info(f"node rank: {get_node_rank()}")


def one_rank_only(rank: int = 0, with_barrier: bool = False) -> Callable:
    """Decorator: run the function on ``rank`` only (others get None); ``with_barrier`` makes everyone wait."""

    def decorator(func: Callable) -> Callable:
        @wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = func(*args, **kwargs) if get_rank() == rank else None
            if with_barrier:
                barrier()
            return result

        return wrapper

    return decorator


@contextmanager
def one_rank_first(rank: int = 0, local: bool = False) -> Iterator[None]:
    """``rank`` (global, or on each node with ``local=True``) runs the block first; the others wait, then run it."""
    current_rank = get_local_rank() if local else get_rank()
    size = get_nproc_per_node() if local else get_world_size()
    if rank >= size or rank < 0:
        raise ValueError(f"rank should be between 0 and {size - 1}, but given {rank}")
    if current_rank != rank:
        barrier()
    yield
    if current_rank == rank:
        barrier()

