"""What a model's construction on the meta device did to its tensors, operation by operation: the record that
``meta_init`` replays module by module.

While ``factory()`` runs under ``torch.device("meta")`` (``record``):
- every ATen operation that writes a tensor (its schema marks the argument written: in-place ops, ``out=``) or draws
  random numbers is logged with its arguments, a tensor argument as (its storage, where it lies in it). A write is
  its storage's, so a view, a ``.data`` alias or an ``nn.Parameter(w)`` made after ``w.normal_()`` all reach the
  module tensor that ends up holding that storage;
- a factory (``torch.ones``, ``torch.randn``...) whose result becomes a module tensor is logged as what makes it;
- ``torch.nn.init``'s functions that return early on a meta tensor (``trunc_normal_``, ``orthogonal_``, ``dirac_``,
  ``sparse_``: they read ``tensor.is_meta``) are logged as calls, to be made again on the real tensor;
- each module's tensor registrations, which place a Hugging Face model's ``post_init``.

``resolve`` then turns the log into each module's steps, in the whole build's order, or raises ``NotReplayable``
naming the module (its qualified name and class) and the reason.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map


class NotReplayable(RuntimeError):
    """The model's initialization cannot be replayed module by module (the message says which module and why)."""


# Factories whose result can become a module tensor: made again on the CPU with the same arguments. A ``*_like``'s
# input gives only its shape, strides and dtype. (``empty`` is not one: it makes no value.)
_MAKERS = {"zeros", "ones", "full", "arange", "eye", "linspace", "logspace", "scalar_tensor", "zeros_like",
           "ones_like", "full_like", "randn", "rand", "randint", "randperm", "normal", "randn_like", "rand_like",
           "randint_like"}
_DRAWS_WITHOUT_GENERATOR = {"native_dropout"}  # draws, and no overload takes a generator
# In-place on a tensor's sizes and strides, not its values.
_METADATA_ONLY = {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "swapdims_", "swapaxes_", "resize_",
                  "resize_as_", "set_", "detach_"}
# torch.nn.init functions that return without writing on a meta tensor (they read tensor.is_meta first).
_SKIP_ON_META = {"_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_"}
_IS_META = torch._C.TensorBase.__dict__["is_meta"]
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = {os.path.join(os.path.dirname(os.path.abspath(__file__)), f"meta_{name}.py")
         for name in ("init", "record", "steps")}  # the meta build's own frames: never the user's line


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True)
class View:
    """Where a tensor lies in its storage, which makes it again on a storage of the same bytes."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> View:
        return cls(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def on(self, base: torch.Tensor) -> torch.Tensor:
        """This view on ``base``: a uint8 tensor standing for the storage, aligned to the dtype."""
        start = base.storage_offset() // self.dtype.itemsize + self.offset
        return torch.empty(0, dtype=self.dtype).set_(base.untyped_storage(), start, self.size, self.stride)

    @property
    def is_floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True)
class Operand:
    """A meta tensor argument as logged: its storage and its view of it."""

    key: int
    view: View


@dataclass(frozen=True)
class Site:
    """Where an operation ran during construction: the user's line, and the modules being built around it."""

    text: str
    building: frozenset[int]  # id() of the modules whose __init__ was running


@dataclass
class Op:
    func: Any  # an OpOverload
    args: tuple
    kwargs: dict
    written: list[Operand]
    out: Operand | None  # a maker's result
    random: bool
    site: Site


@dataclass
class Call:
    fn: Callable[..., Any]
    kwargs: dict  # the tensor argument as an Operand
    site: Site


# --- logging the construction ---------------------------------------------------------------------------------------

def _site() -> Site:
    """The innermost line outside torch and this package's meta modules, and the modules whose ``__init__`` runs."""
    frame, text, building = sys._getframe(2), "", set()
    while frame is not None:
        path = frame.f_code.co_filename
        if not text and not path.startswith(_TORCH_DIR) and os.path.abspath(path) not in _HERE:
            text = f"{os.path.basename(path)}:{frame.f_lineno}"
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        if isinstance(owner, nn.Module):
            if not building:
                text = f"{text} in {type(owner).__name__}.__init__"
            building.add(id(owner))
        frame = frame.f_back
    return Site(text or "?", frozenset(building))


@functools.cache
def _draws(packet: Any) -> bool:
    """Whether an operator draws random numbers: one of its overloads takes a generator (``randn.default`` takes
    none, ``randn.generator`` does)."""
    if packet.__name__ in _DRAWS_WITHOUT_GENERATOR:
        return True
    return any(any("Generator" in str(a.type) for a in getattr(packet, name)._schema.arguments)
               for name in packet.overloads())


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes: the arguments its schema marks ``(a!)`` (in-place ``self``, ``out=``)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


class Log:
    """The construction's events in order, with strong references to every tensor logged (so that no storage, and
    no storage key, is freed and reused while construction runs)."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.tensors: dict[int, torch.Tensor] = {}
        self.problems: list[str] = []

    def operand(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                return value.detach().clone()  # a real CPU operand: its value now
            self.tensors.setdefault(storage_key(value), value)
            return Operand(storage_key(value), View.of(value))
        return value


class _OpLog(TorchDispatchMode):
    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _METADATA_ONLY:
            return func(*args, **kwargs)
        written = _written(func, args, kwargs)
        random = _draws(func.overloadpacket)
        maker = not written and func.overloadpacket.__name__ in _MAKERS and _takes_device_and_dtype(func)
        # Storage keys as before the op; a real tensor written (a CPU temporary) is none of a module's.
        logged = [self.log.operand(t) for t in written if t.device.type == "meta"]
        out = func(*args, **kwargs)
        if written or random or maker:
            made = self.log.operand(out) if maker and isinstance(out, torch.Tensor) else None
            self.log.events.append(Op(func, *tree_map(self.log.operand, (args, kwargs)), logged, made, random,
                                      _site()))
        return out


def _takes_device_and_dtype(func: Any) -> bool:
    names = {a.name for a in func._schema.arguments}
    return {"device", "dtype"} <= names


class _SkipsOnMeta(TorchFunctionMode):
    """Reads of ``tensor.is_meta``: torch.nn.init's functions that skip a meta tensor become calls to make again;
    any other code that asks may do on the meta device other than what it does in a whole build."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _IS_META:
            self._read(sys._getframe(1))
        return func(*args, **(kwargs or {}))

    def _read(self, frame: Any) -> None:
        code = frame.f_code
        if os.path.abspath(code.co_filename) in _HERE:
            return
        fn = frame.f_globals.get(code.co_name)
        if code.co_filename.startswith(_TORCH_DIR) and code.co_name in _SKIP_ON_META and \
                getattr(fn, "__code__", None) is code:
            names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            kwargs = {name: self.log.operand(frame.f_locals[name]) for name in names}
            self.log.events.append(Call(fn, kwargs, _site()))
        else:
            where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name})"
            self.log.problems.append(f"{where} asks whether a tensor is on the meta device during construction: "
                                     "code that does so may skip on the meta device what a whole build does")


class _Registrations:
    def __init__(self, log: Log) -> None:
        self.log = log
        self.handles: list[Any] = []

    def __enter__(self) -> None:
        from torch.nn.modules.module import register_module_buffer_registration_hook as buffer_hook
        from torch.nn.modules.module import register_module_parameter_registration_hook as parameter_hook

        def registered(module: nn.Module, name: str, tensor: Any) -> None:
            self.log.events.append(("register", module, _site()))

        self.handles = [parameter_hook(registered), buffer_hook(registered)]

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()


def record(factory: Callable[[], nn.Module]) -> tuple[nn.Module, Log]:
    """``factory()`` on the meta device, and its log. Refuses a construction that reseeds or draws from the CPU
    generator for real (``torch.manual_seed`` in an ``__init__``): the replay starts from the state before it."""
    log = Log()
    before = torch.get_rng_state()
    try:
        with torch.device("meta"), _Registrations(log), _SkipsOnMeta(log), _OpLog(log):
            model = factory()
    except Exception as exc:  # e.g. .item() of a meta tensor: a whole build may still work, so the caller tries it
        raise NotReplayable(f"the model cannot be built on the meta device: {type(exc).__name__}: {exc}") from exc
    if log.problems:
        raise NotReplayable(log.problems[0])
    if not torch.equal(before, torch.get_rng_state()):
        raise NotReplayable(f"the model ({type(model).__name__}): its construction reseeds or draws from the CPU "
                            "random generator (torch.manual_seed in an __init__, or a tensor made on the CPU): a "
                            "build on the meta device cannot replay the draws that follow it")
    return model, log
