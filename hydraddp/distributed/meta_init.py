"""Models built on the meta device and initialized later, one module at a time, to the bit of a whole build.

``build_on_meta(factory)`` runs ``factory()`` under ``torch.device("meta")``: no tensor gets storage. It records what
construction initialized, in order (the in-place writes to each module's tensors, and where a Hugging Face model's
``post_init`` ran), then runs each of those steps once, on temporary full-size tensors of its one module, to learn the
random-number generator's state before each. ``InitReplay.materialize_module`` then initializes any module, in any
order (FSDP1 asks unit by unit), from its recorded states: the draws of the model built whole under the same seed, with
at most one module's full tensors held beside the shards at any time.

The steps, in the order the whole build runs them:
- ``reset_parameters()`` of each module whose tensors construction wrote (torch's own modules call it in their
  ``__init__``);
- where a Hugging Face ``PreTrainedModel``'s ``post_init`` ran (at the end of its ``__init__``: an inner model's
  before its outer model builds its head), ``_init_weights`` of each module it had not initialized yet, children
  first (``initialize_weights``'s ``smart_apply``). On the meta device ``post_init`` skips that; it is put back.

A model whose tensors these steps do not all write (a parameter drawn with ``torch.randn`` in an ``__init__``, a buffer
computed there), whose tensors other code writes during construction (a re-initialization after it), a step that
reaches beyond its module's own tensors, or parameters shared between modules, cannot be replayed: ``build_on_meta``
raises ``NotReplayable`` naming the module and the reason, and the caller builds the model whole instead.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class NotReplayable(RuntimeError):
    """The model's initialization cannot be replayed module by module (the message says which module and why)."""


@dataclass
class _Step:
    run: Callable[[nn.Module], Any]
    rng_state: torch.Tensor  # the generator's state when the whole build runs it


@dataclass
class InitReplay:
    """Each module's initialization steps with the generator state each one starts from."""

    steps: dict[int, list[_Step]] = field(default_factory=dict)  # id(module) -> its steps, in the whole build's order
    done: set[int] = field(default_factory=set)  # id(module) of those materialized
    # (id(module), name) -> the dtype it was built in: a model cast after building (bf16-true) draws as built, then casts
    dtypes: dict[tuple[int, str], torch.dtype] = field(default_factory=dict)

    def materialize_module(self, module: nn.Module, device: torch.device | str = "cpu") -> None:
        """Give ``module``'s own tensors their initial values (and storage on ``device`` where they are meta); once per
        module. A sharded parameter (a DTensor, after ``fully_shard`` and ``to_empty``) gets this rank's part of the
        full value. The generator is left as it was."""
        if id(module) in self.done:
            return
        self.done.add(id(module))
        own = _own_tensors(module)
        if not own:
            return
        saved = torch.get_rng_state()
        try:
            # On the CPU, whatever the device: the whole build drew from the CPU generator, whose states are recorded.
            with _temporarily_full(module, self.dtypes) as full:
                for step in self.steps.get(id(module), []):
                    torch.set_rng_state(step.rng_state)
                    step.run(module)
        finally:
            torch.set_rng_state(saved)
        for name, value in full.items():
            _store(module, name, own[name], value, device)

    def materialize(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        """Every module of ``model`` not materialized yet."""
        for module in model.modules():
            self.materialize_module(module, device)


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**{n: p for n, p in module._parameters.items() if p is not None},
            **{n: b for n, b in module._buffers.items() if b is not None}}


class _Scratch:
    """One CPU buffer that the dry run's temporary tensors are views of, module after module. Thousands of
    short-lived module-sized tensors, freed between the small allocations the dry run keeps (the generator states),
    leave glibc's heap fragmented: measured, up to 0.9 GB of a 1.6 GB model stayed resident on a rank after they
    were all freed."""

    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.used = 0

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        start = -(-self.used // self.ALIGN) * self.ALIGN
        nbytes = shape.numel() * dtype.itemsize
        self.used = start + nbytes
        return self.buffer[start:self.used].view(dtype).view(shape)

    @classmethod
    def nbytes_for(cls, module: nn.Module, dtypes: dict[tuple[int, str], torch.dtype]) -> int:
        return sum(t.numel() * dtypes.get((id(module), n), t.dtype).itemsize + cls.ALIGN
                   for n, t in _own_tensors(module).items())


@contextlib.contextmanager
def _temporarily_full(module: nn.Module, dtypes: dict[tuple[int, str], torch.dtype] | None = None,
                      scratch: _Scratch | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """``module``'s own tensors replaced, for the block, by full-size CPU ones filled with NaN (an integer buffer: its
    type's minimum), so that a step that leaves one unwritten shows it; yields them by name. With ``scratch``, they are
    views of its buffer, valid until the next module's."""
    saved_params, saved_buffers = dict(module._parameters), dict(module._buffers)
    full: dict[str, torch.Tensor] = {}
    if scratch is not None:
        scratch.used = 0
    for name, tensor in _own_tensors(module).items():
        shape, dtype = tensor.shape, (dtypes or {}).get((id(module), name), tensor.dtype)
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).min
        value = torch.full(shape, fill, dtype=dtype) if scratch is None else scratch.take(shape, dtype).fill_(fill)
        full[name] = value
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(value, requires_grad=tensor.requires_grad)
        else:
            module._buffers[name] = value
    try:
        with torch.no_grad():
            yield full
        full.update({n: p.data for n, p in module._parameters.items() if n in full and p is not None})
        full.update({n: b for n, b in module._buffers.items() if n in full and b is not None})
    finally:
        module._parameters.update(saved_params)
        module._buffers.update(saved_buffers)


def _store(module: nn.Module, name: str, target: torch.Tensor, value: torch.Tensor, device: torch.device | str) -> None:
    """Put ``value`` (the full tensor) where ``target`` (meta, or a DTensor with a meta local part) was."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(target, DTensor):
            # src_data_rank=None: every rank computed the same full value, so each keeps its part without sending.
            target_local = target._local_tensor
            if target_local.is_meta:
                raise NotReplayable(f"{type(module).__name__}.{name}: its shard has no storage yet; call "
                                    "model.to_empty(device=...) before materializing a sharded model")
            local = distribute_tensor(value.to(target_local.device), target.device_mesh, target.placements,
                                      src_data_rank=None).to_local()
            target_local.copy_(local)  # in the shard's dtype
        elif name in module._parameters:
            module._parameters[name] = nn.Parameter(value.to(device, target.dtype), requires_grad=target.requires_grad)
        else:
            module._buffers[name] = value.to(device, target.dtype)


class _NoMetaOperands(TorchDispatchMode):
    """Flags an operation on a meta tensor: a step that reaches a tensor of another (not materialized) module."""

    def __init__(self) -> None:
        super().__init__()
        self.touched_meta = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in tree_leaves((args, kwargs or {}))):
            self.touched_meta = True
        return func(*args, **(kwargs or {}))


class _InPlaceLog(TorchDispatchMode):
    """The tensors that in-place operations write during construction, in order (a view counts as its base)."""

    def __init__(self, events: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            written = args[0] if args[0]._base is None else args[0]._base
            self.events.append(("write", id(written)))  # an id: the tensor may be a temporary of the construction
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _registrations_logged(events: list[tuple[str, Any]]) -> Iterator[None]:
    """Each module's tensor registrations during construction, in order: when it was built."""
    from torch.nn.modules.module import register_module_buffer_registration_hook, register_module_parameter_registration_hook

    def registered(module: nn.Module, name: str, tensor: Any) -> None:
        events.append(("register", module))

    handles = [register_module_parameter_registration_hook(registered),
               register_module_buffer_registration_hook(registered)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _with_post_inits(model: nn.Module, events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``events`` with a ("post_init", model) where each Hugging Face ``PreTrainedModel`` ran its ``post_init``: at the
    end of its ``__init__``, after everything in it was built (an inner model's before its outer model builds its
    head). On the meta device ``post_init`` skips the initialization, so the whole build's is put back here."""
    transformers = sys.modules.get("transformers")  # a Hugging Face model imported it while it was built
    if transformers is None:
        return events
    subtree = {}
    for pretrained in (m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)):
        subtree[pretrained] = {id(m) for m in pretrained.modules()}
    last = {pretrained: max((i for i, (_, module) in enumerate(events) if id(module) in ids), default=-1)
            for pretrained, ids in subtree.items()}
    merged: list[tuple[str, Any]] = []
    # By the event each ends after; an inner model before the outer one ending at the same event (it returns first).
    pending = sorted(last.items(), key=lambda item: (item[1], len(subtree[item[0]])))
    for index, event in enumerate(events):
        merged.append(event)
        while pending and pending[0][1] == index:
            merged.append(("post_init", pending.pop(0)[0]))
    merged.extend(("post_init", pretrained) for pretrained, _ in pending)
    return merged


def _plan(factory: Callable[[], nn.Module]) -> tuple[nn.Module, list[tuple[nn.Module, Callable[[nn.Module], Any]]]]:
    """``factory()`` on the meta device, and the initialization steps a whole build runs, in its order: a module's
    ``reset_parameters`` where construction wrote its tensors, a Hugging Face model's ``_init_weights`` of each module
    its ``post_init`` reached (children first; once per module, as HF marks them)."""
    events: list[tuple[str, Any]] = []
    with torch.device("meta"), _registrations_logged(events), _InPlaceLog(events):
        model = factory()
    owner = {id(t): m for m in model.modules() for t in _own_tensors(m).values()}
    # Writes by their module; registrations only place the post_inits.
    events = [("write", owner[what]) if kind == "write" and what in owner else (kind, what)
              for kind, what in events if kind != "write" or what in owner]
    events = _with_post_inits(model, events)
    steps: list[tuple[nn.Module, Callable[[nn.Module], Any]]] = []
    reset: set[int] = set()
    hf_done: set[int] = set()
    last_writer: nn.Module | None = None
    for kind, what in events:
        if kind == "register":
            continue
        if kind == "write":
            module = what
            if module is last_writer:
                continue  # the same module's next write
            if id(module) in reset:
                raise NotReplayable(f"{type(module).__name__}'s tensors are written at two separate times during "
                                    "construction")
            if not callable(getattr(module, "reset_parameters", None)):
                raise NotReplayable(f"{type(module).__name__}'s tensors are written during construction by code other "
                                    "than its reset_parameters()")
            reset.add(id(module))
            last_writer = module
            steps.append((module, lambda m: m.reset_parameters()))
        else:  # post_init of a PreTrainedModel: its _initialize_weights over its modules, as smart_apply
            last_writer = None
            for module, init_owner in _hf_post_order(what):
                if id(module) not in hf_done:
                    hf_done.add(id(module))
                    steps.append((module, lambda m, init_owner=init_owner: init_owner._init_weights(m)))
    return model, steps


def _hf_post_order(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(module, the PreTrainedModel whose ``_init_weights`` it gets), children first, as ``smart_apply``."""
    from transformers import PreTrainedModel

    visited: list[tuple[nn.Module, nn.Module]] = []

    def walk(module: nn.Module, init_owner: nn.Module) -> None:
        for child in module.children():
            walk(child, child if isinstance(child, PreTrainedModel) else init_owner)
        visited.append((module, init_owner))

    walk(model, model)
    return visited


def shared_tensors(model: nn.Module) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, tensor in _own_tensors(module).items():
            owners.setdefault(id(tensor), []).append(f"{module_name}.{name}" if module_name else name)
    return {key: names for key, names in owners.items() if len(set(names)) > 1}


REPLAY_ATTR = "_hydraddp_init_replay"


def replay_of(model: nn.Module) -> InitReplay | None:
    """The replay ``build_on_meta`` attached to ``model``, while some of its tensors are still meta."""
    replay = getattr(model, REPLAY_ATTR, None)
    return replay if replay is not None and any(t.is_meta for t in (*model.parameters(), *model.buffers())) else None


def build_on_meta(factory: Callable[[], nn.Module]) -> tuple[nn.Module, InitReplay]:
    """``factory()`` built on the meta device, and the replay that initializes it as ``factory()`` would have, from the
    generator's state now (seed it first, as for a whole build). Leaves the generator where a whole build would.
    The replay is also attached to the model: ``auto_model`` materializes it after sharding (``replay_of``).

    Raises ``NotReplayable`` (with the module and the reason) when the model's initialization cannot be replayed.
    """
    start = torch.get_rng_state()
    model, planned = _plan(factory)
    shared = shared_tensors(model)
    if shared:
        names = next(iter(shared.values()))
        raise NotReplayable(f"{' and '.join(names)} are one tensor (tied weights): they are initialized as one")
    replay = InitReplay(dtypes={(id(m), n): t.dtype for m in model.modules() for n, t in _own_tensors(m).items()})
    covered: dict[int, set[str]] = {}
    scratch = _Scratch(max((_Scratch.nbytes_for(m, replay.dtypes) for m, _ in planned), default=0))
    mask = torch.empty(1 << 20, dtype=torch.bool)
    torch.set_rng_state(start)
    for module, run in planned:
        state = torch.get_rng_state()
        watch = _NoMetaOperands()
        with _temporarily_full(module, replay.dtypes, scratch) as full, watch:
            run(module)
        if watch.touched_meta:
            raise NotReplayable(f"{type(module).__name__}'s initialization writes tensors of other modules")
        replay.steps.setdefault(id(module), []).append(_Step(run, state))
        done = covered.setdefault(id(module), set())
        done.update(name for name, value in full.items() if not _any_unwritten(value, mask))
    for module_name, module in model.named_modules():
        missing = sorted(set(_own_tensors(module)) - covered.get(id(module), set()))
        if missing:
            where = f"{module_name}." if module_name else ""
            raise NotReplayable(f"{', '.join(where + n for n in missing)} ({type(module).__name__}) is not set by any "
                                "reset_parameters() or Hugging Face _init_weights: its value is made in __init__")
    object.__setattr__(model, REPLAY_ATTR, replay)  # not a submodule: a plain attribute
    return model, replay


def _any_unwritten(value: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether a temporary tensor still holds its fill somewhere, tested a chunk at a time into ``mask`` (a bool
    tensor kept for the whole dry run): a fresh mask per tensor, freed between the generator states the dry run keeps,
    fragments the heap as module-sized tensors do (see ``_Scratch``)."""
    flat, chunk = value.reshape(-1), mask.numel()
    floating = value.dtype.is_floating_point or value.dtype.is_complex
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk]
        found = mask[:part.numel()]
        # NaN is the one value unequal to itself
        torch.ne(part, part, out=found) if floating else torch.eq(part, torch.iinfo(value.dtype).min, out=found)
        if found.any():
            return True
    return False
