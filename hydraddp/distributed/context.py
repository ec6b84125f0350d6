"""The computation context: one object that knows this process's rank, device and collectives.

Type handling (numbers, strings, arbitrary objects) lives here once; each backend writes only the
small ``_do_*`` primitives on tensors and picklable objects. ``SerialContext`` is the null model, so
the same user code runs at world size 1 with no process group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from numbers import Number
from typing import Any

import torch

REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AND", "OR", "AVERAGE")


class Context(ABC):
    """What ``hydraddp.distributed``'s functional API reads. Create through ``initialize`` or the env."""

    name: str = "context"

    @abstractmethod
    def rank(self) -> int: ...

    @abstractmethod
    def local_rank(self) -> int: ...

    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def nproc_per_node(self) -> int: ...

    @abstractmethod
    def nnodes(self) -> int: ...

    @abstractmethod
    def node_rank(self) -> int: ...

    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def backend(self) -> str | None: ...

    @abstractmethod
    def finalize(self) -> None: ...

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def _do_all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor: ...

    @abstractmethod
    def _do_all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _do_all_gather_object(self, obj: Any) -> list[Any]: ...

    @abstractmethod
    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _do_broadcast_object(self, obj: Any, src: int) -> Any: ...

    # Collectives with ignite's type rules: a tensor comes back as a tensor, a number as a number,
    # a string or any other picklable object through the object collectives.
    def all_reduce(self, value: torch.Tensor | float, op: str = "SUM") -> torch.Tensor | float:
        op = op.upper()
        if op not in REDUCE_OPS:
            raise ValueError(f"op={op!r} is not a reduce op; use one of {', '.join(REDUCE_OPS)}")
        if isinstance(value, torch.Tensor):
            return self._do_all_reduce(value, op)
        if isinstance(value, Number):
            dtype = torch.float64 if self.device().type == "cpu" else torch.float32
            reduced = self._do_all_reduce(torch.tensor(value, device=self.device(), dtype=dtype), op)
            return type(value)(reduced.item())
        raise TypeError(f"all_reduce takes a tensor or a number, got {type(value).__name__}")

    def all_gather(self, value: Any) -> torch.Tensor | list[Any]:
        """Tensors are concatenated along dim 0 (ignite's rule); anything else becomes a list by rank."""
        if isinstance(value, torch.Tensor):
            return self._do_all_gather(value.unsqueeze(0) if value.dim() == 0 else value)
        if isinstance(value, Number) and not isinstance(value, bool):
            gathered = self._do_all_gather(torch.tensor([value], device=self.device(), dtype=torch.float64))
            return [type(value)(v) for v in gathered.tolist()]
        return self._do_all_gather_object(value)

    def broadcast(self, value: Any, src: int = 0, safe_mode: bool = False) -> Any:
        """``safe_mode`` (ignite's flag) lets non-source ranks pass None: everything goes as an object."""
        if isinstance(value, torch.Tensor) and not safe_mode:
            return self._do_broadcast(value, src)
        return self._do_broadcast_object(value, src)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend()!r}, rank={self.rank()}, "
            f"world_size={self.world_size()}, device={self.device()})"
        )


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


class SerialContext(Context):
    """World size 1, no process group: every collective is the identity."""

    name = "serial"

    def rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def world_size(self) -> int:
        return 1

    def nproc_per_node(self) -> int:
        return 1

    def nnodes(self) -> int:
        return 1

    def node_rank(self) -> int:
        return 0

    def device(self) -> torch.device:
        return default_device()

    def backend(self) -> str | None:
        return None

    def finalize(self) -> None:
        pass

    def barrier(self) -> None:
        pass

    def _do_all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor

    def _do_all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _do_all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    def _do_broadcast_object(self, obj: Any, src: int) -> Any:
        return obj
