"""A model's construction log (``meta_record``) as each module's initialization steps, in the whole build's order.

A step writes one module's tensors and nothing else: an ATen operation (``OpStep``), a factory that made a tensor
(``MakeStep``), a ``torch.nn.init`` call that skipped the meta tensor (``CallStep``), or a Hugging Face
``_init_weights`` of the module where its model's ``post_init`` ran (``HFStep``). A random draw into a tensor that the
finished model does not hold (a temporary, a layer replaced later) is kept too, as a step of a temporary: the dry run
makes it, so that every later draw starts where the whole build's does. Whatever cannot be replayed raises
``NotReplayable`` naming the module (its qualified name and class) and the reason.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from hydraddp.parallel.meta_record import Call, Log, NotReplayable, Op, Operand, Site, View, storage_key


@dataclass(frozen=True)
class Ref:
    """A tensor argument of a step: a view of one of its module's storages (by index)."""

    storage: int
    view: View

    def on(self, bases: list[torch.Tensor]) -> torch.Tensor:
        return self.view.on(bases[self.storage])


def _on(value: Any, bases: list[torch.Tensor]) -> Any:
    return tree_map(lambda a: a.on(bases) if isinstance(a, Ref) else a, value)


# Each step runs on its module's storages (``bases``: uint8 tensors, one per storage, that its tensors are views of).

@dataclass
class OpStep:
    func: Any  # an OpOverload
    args: tuple
    kwargs: dict

    def run(self, module: nn.Module | None, bases: list[torch.Tensor]) -> None:
        args, kwargs = _on((self.args, self.kwargs), bases)
        self.func(*args, **kwargs)


@dataclass
class MakeStep:
    func: Any
    args: tuple  # a *_like's input as a View: made as an uninitialized tensor of its geometry
    kwargs: dict
    out: Ref

    def run(self, module: nn.Module | None, bases: list[torch.Tensor]) -> None:
        args, kwargs = tree_map(lambda a: torch.empty_strided(a.size, a.stride, dtype=a.dtype)
                                if isinstance(a, View) else a, (self.args, self.kwargs))
        value = self.func(*args, **{**kwargs, "device": torch.device("cpu"), "dtype": self.out.view.dtype})
        self.out.on(bases).copy_(value)


@dataclass
class CallStep:
    fn: Callable[..., Any]
    kwargs: dict

    def run(self, module: nn.Module | None, bases: list[torch.Tensor]) -> None:
        self.fn(**_on(self.kwargs, bases))


@dataclass
class HFStep:
    """A Hugging Face ``PreTrainedModel``'s ``_init_weights`` of one module, which chooses by the module's class."""

    init_owner: nn.Module
    module_class: type

    def run(self, module: nn.Module | None, bases: list[torch.Tensor]) -> None:
        self.init_owner._init_weights(module)


Step = OpStep | MakeStep | CallStep | HFStep


@dataclass
class ModuleRecord:
    """One module's tensors (name -> storage index and view), its storages' sizes, and its steps, each with the
    generator state it starts from (the dry run fills those)."""

    cls: type | None  # None: a temporary of the construction, whose steps only advance the generator
    storages: list[int] = field(default_factory=list)  # bytes
    tensors: dict[str, tuple[int, View]] = field(default_factory=dict)
    steps: list[tuple[torch.Tensor, Step]] = field(default_factory=list)

    def views(self, bases: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: view.on(bases[index]) for name, (index, view) in self.tensors.items()}


@dataclass
class InitRecord:
    """What a meta build's initializers did, module by module, in the whole build's order: what the build replays."""

    modules: dict[str, nn.Module]  # by qualified name, as built
    records: dict[str, ModuleRecord]  # by qualified name; a temporary's as "<temporary N>"
    order: list[tuple[str, Step]]  # every step, in the whole build's order


def own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**{n: p for n, p in module._parameters.items() if p is not None},
            **{n: b for n, b in module._buffers.items() if b is not None}}


def describe(name: str, module_class: type | None, tensor: str | None = None) -> str:
    """``blocks.0.attn.weight (Linear)``: what an error names."""
    where = ".".join(part for part in (name, tensor) if part) or "the model"
    return f"{where} ({module_class.__name__ if module_class else 'a temporary'})"


def _records(modules: dict[str, nn.Module]) -> tuple[dict[str, ModuleRecord], dict[int, tuple[str, int]]]:
    """Each module's record, and each module storage's owner: (module name, its storage index)."""
    records, owners = {}, {}
    for name, module in modules.items():
        record = records[name] = ModuleRecord(type(module))
        for tensor_name, tensor in own_tensors(module).items():
            key = storage_key(tensor)
            if key in owners and owners[key][0] != name:
                other = owners[key][0]
                other_tensor = next(t for t, (i, _) in records[other].tensors.items() if i == owners[key][1])
                raise NotReplayable(f"{describe(name, type(module), tensor_name)} shares its storage with "
                                    f"{describe(other, type(modules[other]), other_tensor)}: they are initialized "
                                    "as one (tied weights)")
            if key not in owners:
                owners[key] = (name, len(record.storages))
                record.storages.append(tensor.untyped_storage().nbytes())
            record.tensors[tensor_name] = (owners[key][1], View.of(tensor))
    return records, owners


class _Resolver:
    """Turns the log's events into (module name, step), refusing what cannot be replayed."""

    def __init__(self, modules: dict[str, nn.Module], log: Log) -> None:
        self.modules, self.log = modules, log
        self.records, self.owners = _records(modules)
        self.temporaries: dict[int, str] = {}  # storage key -> its temporary's record name

    def who(self, key: int, site: Site) -> str:
        name, index = self.owners[key]
        record = self.records[name]
        tensor = next((t for t, (i, _) in record.tensors.items() if i == index), None)
        return f"{describe(name, record.cls, tensor)}, written at {site.text}"

    def op(self, op: Op) -> tuple[str, Step] | None:
        keys = {o.key for o in op.written}
        owned = [k for k in keys if k in self.owners]
        name = op.func.overloadpacket.__name__
        if owned:
            who = self.who(owned[0], op.site)
            if len(keys) > 1:
                raise NotReplayable(f"{who}: {name} writes it and another tensor in one operation")
            _refuse_foreign(who, name, op, keys)
            _refuse_generator(who, op)
            module, index = self.owners[owned[0]]
            return module, OpStep(op.func, *_refs((op.args, op.kwargs), index))
        if op.out is not None and op.out.key in self.owners:
            who = self.who(op.out.key, op.site)
            _refuse_foreign(who, name, op, {op.out.key})
            _refuse_generator(who, op)
            module, index = self.owners[op.out.key]
            return module, _make(op, index)
        if not op.random or _generator_of(op) is not None:
            return None  # its values reach no module; with a generator of its own, nor does the draw
        target = op.out.key if op.out is not None else next(iter(keys), None)
        if target is None or len(keys) > 1 or any(o.key != target and not _like_input(op, o) for o in _operands(op)):
            raise NotReplayable(f"{op.site.text}: {name} draws random numbers from tensors computed during "
                                "construction, which a build on the meta device does not have; every later draw "
                                "of the whole build depends on it")
        temporary = self._temporary(target)
        return temporary, (_make(op, 0) if op.out is not None else OpStep(op.func, *_refs((op.args, op.kwargs), 0)))

    def _temporary(self, key: int) -> str:
        """A tensor the finished model does not hold (a temporary, a layer replaced later): a draw into it is made
        again in the dry run, on a tensor of its own, for the generator's sake."""
        if key not in self.temporaries:
            self.temporaries[key] = name = f"<temporary {len(self.temporaries)}>"
            self.records[name] = ModuleRecord(None, [self.log.tensors[key].untyped_storage().nbytes()])
        return self.temporaries[key]

    def call(self, call: Call) -> tuple[str, Step] | None:
        tensor = call.kwargs.get("tensor")
        if not isinstance(tensor, Operand):
            return None
        if tensor.key in self.owners:
            _refuse_generator(self.who(tensor.key, call.site), call)
            module, index = self.owners[tensor.key]
            return module, CallStep(call.fn, _refs(call.kwargs, index))
        if call.kwargs.get("generator") is not None:
            return None
        return self._temporary(tensor.key), CallStep(call.fn, _refs(call.kwargs, 0))


def _refs(value: Any, index: int) -> Any:
    return tree_map(lambda a: Ref(index, a.view) if isinstance(a, Operand) else a, value)


def _refuse_generator(who: str, event: Op | Call) -> None:
    if _generator_of(event) is not None:
        raise NotReplayable(f"{who}: it is drawn from a torch.Generator of its own (generator=...), whose state at "
                            "that point a build on the meta device does not have")


def _operands(event: Op) -> list[Operand]:
    return [a for a in tree_leaves((event.args, event.kwargs)) if isinstance(a, Operand)]


def _like_input(op: Op, operand: Operand) -> bool:
    return op.out is not None and op.func.overloadpacket.__name__.endswith("_like") and op.args[:1] == (operand,)


def _generator_of(event: Op | Call) -> Any:
    values = tree_leaves((event.args, event.kwargs)) if isinstance(event, Op) else list(event.kwargs.values())
    return next((v for v in values if isinstance(v, torch.Generator)), None)


def _refuse_foreign(who: str, name: str, op: Op, keys: set[int]) -> None:
    """A step may read only its own tensor: another tensor's value during construction is not there to replay."""
    if any(o.key not in keys and not _like_input(op, o) for o in _operands(op)):
        raise NotReplayable(f"{who}: {name} computes it from another tensor made during construction (a value "
                            "computed in __init__), which a build on the meta device does not have")


def _make(op: Op, index: int) -> MakeStep:
    args, kwargs = tree_map(lambda a: a.view if isinstance(a, Operand) else a, (op.args, op.kwargs))
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "dtype")}
    return MakeStep(op.func, args, kwargs, Ref(index, op.out.view))


def resolve(model: nn.Module, log: Log) -> InitRecord:
    """Each module's record, and every step in the whole build's order (Hugging Face ``_init_weights`` steps placed
    where each ``post_init`` ran)."""
    modules = dict(model.named_modules())
    resolver = _Resolver(modules, log)
    events: list[tuple[str | None, Any, Site]] = []  # (module name or None for a registration, step, site)
    for event in log.events:
        if isinstance(event, tuple):  # ("register", module, site)
            events.append((None, event[1], event[2]))
            continue
        placed = resolver.op(event) if isinstance(event, Op) else resolver.call(event)
        if placed is not None:
            events.append((placed[0], placed[1], event.site))
    order = _with_post_inits(model, {id(m): n for n, m in modules.items()}, events)
    return InitRecord(modules, resolver.records, order)


def _with_post_inits(model: nn.Module, names: dict[int, str],
                     events: list[tuple[str | None, Any, Site]]) -> list[tuple[str, Step]]:
    """The steps, with each Hugging Face ``PreTrainedModel``'s ``_init_weights`` steps where its ``post_init`` ran: at
    the end of its ``__init__``, after the last event inside it (an inner model's before its outer model builds its
    head). On the meta device ``post_init`` skips the initialization, so the whole build's is put back here."""
    transformers = sys.modules.get("transformers")  # a Hugging Face model imported it while it was built
    pretrained = [m for m in model.modules() if transformers and isinstance(m, transformers.PreTrainedModel)]
    last = {id(p): max((i for i, (_, _, site) in enumerate(events) if id(p) in site.building), default=len(events))
            for p in pretrained}
    # By the event each ends after; an inner model before the outer one ending at the same event (it returns first).
    pending = sorted(pretrained, key=lambda p: (last[id(p)], sum(1 for _ in p.modules())))
    order: list[tuple[str, Step]] = []
    initialized: set[int] = set()
    # A module made after a post_init ran never got its _init_weights: peft's adapters, injected into the built model
    # (that step once drew for them too, and every later module's values were off by those draws).
    born: dict[int, int] = {}
    for index, (name, step, _) in enumerate(events):
        if name is None:  # a registration: step is the module
            born.setdefault(id(step), index)

    def post_init(upto: int) -> None:
        while pending and last[id(pending[0])] <= upto:
            for module, init_owner in _hf_post_order(pending.pop(0)):
                if id(module) not in initialized and born.get(id(module), -1) <= upto:  # once, as HF marks them
                    initialized.add(id(module))
                    order.append((names[id(module)], HFStep(init_owner, type(module))))

    for index, (name, step, _) in enumerate(events):
        if name is not None:
            order.append((name, step))
        post_init(index)
    post_init(len(events))
    return order


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
