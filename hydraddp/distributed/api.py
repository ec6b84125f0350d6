"""The functional API (ignite's ``idist`` names), all reading one ``Context`` object.

The context is set by ``initialize``/``Parallel``, or found once from an existing process group
(torchrun script, Horovod) and then kept. While nothing is found, the serial context answers.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from hydraddp.distributed import machine
from hydraddp.distributed.context import Context, SerialContext
from hydraddp.distributed.horovod import HOROVOD, HorovodContext, has_hvd_support
from hydraddp.distributed.native import NATIVE_BACKENDS, NativeContext, native_backends_available

_SERIAL = SerialContext()
_context: Context | None = None


def _found_context() -> Context | None:
    native = NativeContext.create_from_context()
    if native is not None:
        return native
    # Only look at Horovod if the user already imported it: importing it costs seconds.
    if "horovod.torch" in sys.modules:
        return HorovodContext.create_from_context()
    return None


def current() -> Context:
    """The context every getter reads."""
    global _context
    if _context is None:
        _context = _found_context()
    return _context if _context is not None else _SERIAL


def available_backends() -> tuple[str, ...]:
    return native_backends_available() + ((HOROVOD,) if has_hvd_support() else ())


def initialize(backend: str, **kwargs: Any) -> Context:
    """Start the distributed context for ``backend`` (``gloo``, ``nccl``, ``mpi`` or ``horovod``).

    Rank and world size come from the launcher's environment (torchrun, SLURM, mpirun, horovodrun).

    >>> import hydraddp.distributed as idist
    >>> idist.initialize("gloo")  # doctest: +SKIP
    """
    global _context
    if _context is not None:
        raise RuntimeError(f"A distributed context is already active ({_context!r}); call finalize() first")
    if backend in (*NATIVE_BACKENDS, HOROVOD):
        machine.raise_for_problems(machine.combination(backend=backend), ["backend"])
    if backend in NATIVE_BACKENDS:
        _context = NativeContext.create_from_backend(backend, **kwargs)
    elif backend == HOROVOD:
        _context = HorovodContext.create_from_backend(backend, **kwargs)
    else:
        valid = ", ".join((*NATIVE_BACKENDS, HOROVOD))
        raise ValueError(f"backend={backend!r} is not a distributed backend; use one of: {valid}")
    return _context


def finalize() -> None:
    """Tear down the context that ``initialize`` started; afterwards the serial context answers."""
    global _context
    if _context is not None:
        _context.finalize()
    _context = None


def get_rank() -> int:
    return current().rank()


def get_local_rank() -> int:
    return current().local_rank()


def get_world_size() -> int:
    return current().world_size()


def get_nproc_per_node() -> int:
    return current().nproc_per_node()


def get_nnodes() -> int:
    return current().nnodes()


def get_node_rank() -> int:
    return current().node_rank()


def device() -> torch.device:
    return current().device()


def backend() -> str | None:
    return current().backend()


def barrier() -> None:
    current().barrier()


def all_reduce(value: Any, op: str = "SUM") -> Any:
    return current().all_reduce(value, op)


def all_gather(value: Any) -> Any:
    return current().all_gather(value)


def broadcast(value: Any, src: int = 0, safe_mode: bool = False) -> Any:
    return current().broadcast(value, src, safe_mode)
