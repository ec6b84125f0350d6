"""The computation model: one object that knows this process's rank, device and collectives (ignite's design).

Type handling (numbers, strings, paths, arbitrary objects, groups) lives here once; each backend writes only the
small ``_do_*`` primitives on tensors and picklable objects. ``_SerialModel`` is the null model, so the same user
code runs at world size 1 with no process group. Names, signatures and error messages are ignite 0.5.5's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from numbers import Number
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

_torch_version_gt_112 = Version(torch.__version__) > Version("1.12.0")

REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AND", "OR", "AVERAGE")


def _reduce_op(op: str) -> str:
    if not isinstance(op, str) or op.upper() not in REDUCE_OPS:
        raise ValueError(f"Unsupported reduction operation: '{op}'")
    return op.upper()


def _is_rank_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) for item in value)


class ComputationModel(ABC):
    """What ``hydraddp.distributed``'s functional API reads. Create through ``initialize`` or the environment."""

    name: str = "computation-model"
    available_backends: tuple[str, ...] = ()
    # The local rank a user hinted with ``set_local_rank`` for a process group they started themselves.
    _ext_local_rank: int | None = None

    @abstractmethod
    def get_rank(self) -> int: ...

    @abstractmethod
    def get_local_rank(self) -> int: ...

    @abstractmethod
    def get_world_size(self) -> int: ...

    @abstractmethod
    def get_nproc_per_node(self) -> int: ...

    @abstractmethod
    def get_nnodes(self) -> int: ...

    @abstractmethod
    def get_node_rank(self) -> int: ...

    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def backend(self) -> str | None: ...

    @abstractmethod
    def finalize(self) -> None: ...

    @abstractmethod
    def barrier(self) -> None: ...

    @staticmethod
    @abstractmethod
    def create_from_context() -> ComputationModel | None: ...

    @staticmethod
    @abstractmethod
    def create_from_backend(backend: str, **kwargs: Any) -> ComputationModel: ...

    @staticmethod
    @abstractmethod
    def spawn(*args: Any, **kwargs: Any) -> Any: ...

    @abstractmethod
    def _do_all_reduce(self, tensor: torch.Tensor, op: str = "SUM", group: Any | None = None) -> torch.Tensor: ...

    @abstractmethod
    def _do_all_gather(self, tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor: ...

    @abstractmethod
    def _do_all_gather_object(self, obj: Any, group: Any | None = None) -> list[Any]: ...

    @abstractmethod
    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _do_broadcast_object(self, obj: Any, src: int) -> Any: ...

    @abstractmethod
    def _do_new_group(self, ranks: list[int], **kwargs: Any) -> Any: ...

    @abstractmethod
    def _rank_not_in_group(self, group: Any) -> bool: ...

    def _get_max_length(self, x: str, device: torch.device) -> int:
        """The longest ``x`` over all ranks. Unused by hydraddp; kept because ignite's own tests call it on every
        computation model (tests/ignite_reference)."""
        size = self._do_all_reduce(torch.tensor([len(x)], device=device), op="MAX")
        return int(size.item())

    def _on_device(self, tensor: torch.Tensor, fn: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run a collective on this model's device and give the result back where the input was."""
        device = self.device()
        result = fn(tensor.to(device) if tensor.device != device else tensor, *args, **kwargs)
        return result.to(tensor.device) if result.device != tensor.device else result

    # Collectives with ignite's type rules: a tensor comes back as a tensor (on its own device), a number as a
    # number, a string or any other picklable object through the object collectives.
    def all_reduce(self, tensor: torch.Tensor | float, op: str = "SUM", group: Any | None = None) -> torch.Tensor | float:
        if not isinstance(tensor, (torch.Tensor, Number)):
            raise TypeError(f"Unhandled input type {type(tensor)}")
        op = _reduce_op(op)
        if isinstance(tensor, torch.Tensor):
            return self._on_device(tensor, self._do_all_reduce, op, group=group)
        dtype = torch.double if isinstance(tensor, float) else None
        return self._do_all_reduce(torch.tensor(tensor, device=self.device(), dtype=dtype), op, group=group).tolist()

    def all_gather(self, tensor: Any, group: Any | None = None) -> torch.Tensor | list[Any]:
        """Tensors are concatenated along dim 0 (a 0-d tensor counts as shape [1]); numbers, strings and any
        other picklable object come back as a list by rank."""
        if isinstance(tensor, torch.Tensor):
            return self._on_device(tensor, self._do_all_gather, group=group)
        if isinstance(tensor, Number) and not isinstance(tensor, bool):
            dtype = torch.double if isinstance(tensor, float) else None
            return self._do_all_gather(torch.tensor(tensor, device=self.device(), dtype=dtype), group=group).tolist()
        return self._do_all_gather_object(tensor, group=group)

    def new_group(self, ranks: list[int], **kwargs: Any) -> Any:
        if not _is_rank_list(ranks):
            raise ValueError("Argument ranks should be list of int")
        return self._do_new_group(ranks, **kwargs)

    def broadcast(self, tensor: torch.Tensor | float | str | Path | None, src: int = 0,
                  safe_mode: bool = False) -> torch.Tensor | float | str | Path:
        """``safe_mode`` lets non-source ranks pass anything (None included): they get the source's value and
        type. A number comes back as a float, as in ignite (it travels as float32)."""
        if not (tensor is None or isinstance(tensor, (torch.Tensor, Number, str, Path))):
            raise TypeError(f"Unhandled input type {type(tensor)}")
        is_src = self.get_rank() == src
        if tensor is None:
            if is_src:
                raise ValueError("Source data can not be None")
            if not safe_mode:
                raise ValueError("Argument safe_mode should be True if None is passed for non src rank")
        if isinstance(tensor, torch.Tensor) and not safe_mode:
            return self._on_device(tensor, self._do_broadcast, src)
        value = self._do_broadcast_object(tensor if is_src else None, src)
        if isinstance(value, torch.Tensor):
            return tensor if is_src else value.to(self.device())
        if isinstance(value, Number):
            return torch.tensor([value], dtype=torch.float).item()
        return value

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(backend={self.backend()!r}, rank={self.get_rank()}, "
                f"world_size={self.get_world_size()}, device={self.device()})")


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _torch_version_gt_112 and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


class _SerialModel(ComputationModel):
    """World size 1, no process group: every collective is the identity."""

    name = "serial"
    available_backends = ()

    def __init__(self, _backend: str | None = None, **kwargs: Any) -> None:
        pass

    def get_rank(self) -> int:
        return 0

    def get_local_rank(self) -> int:
        return 0

    def get_world_size(self) -> int:
        return 1

    def get_nproc_per_node(self) -> int:
        return 1

    def get_nnodes(self) -> int:
        return 1

    def get_node_rank(self) -> int:
        return 0

    def device(self) -> torch.device:
        return default_device()

    def backend(self) -> str | None:
        return None

    def finalize(self) -> None:
        pass

    def barrier(self) -> None:
        pass

    @staticmethod
    def create_from_context() -> _SerialModel:
        return _SerialModel()

    @staticmethod
    def create_from_backend(backend: str | None = None, **kwargs: Any) -> _SerialModel:
        return _SerialModel()

    @staticmethod
    def spawn(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("Serial computation model does not implement spawn method")

    def all_reduce(self, tensor: torch.Tensor | float, op: str = "SUM", group: Any | None = None) -> torch.Tensor | float:
        return tensor

    def all_gather(self, tensor: Any, group: Any | None = None) -> torch.Tensor | list[Any]:
        return tensor if isinstance(tensor, torch.Tensor) else [tensor]

    def broadcast(self, tensor: Any, src: int = 0, safe_mode: bool = False) -> Any:
        if tensor is None:
            raise ValueError("Argument tensor should not be None")
        return tensor

    def _do_all_reduce(self, tensor: torch.Tensor, op: str = "SUM", group: Any | None = None) -> torch.Tensor:
        return tensor

    def _do_all_gather(self, tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor:
        return tensor

    def _do_all_gather_object(self, obj: Any, group: Any | None = None) -> list[Any]:
        return [obj]

    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    def _do_broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def _do_new_group(self, ranks: list[int], **kwargs: Any) -> Any:
        return ranks

    def _rank_not_in_group(self, group: Any) -> bool:
        return False

    def __repr__(self) -> str:
        return "_SerialModel()"
