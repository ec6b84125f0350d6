"""Models built on the meta device and initialized later, one module at a time, to the bit of a whole build.

``build_on_meta(factory)`` runs ``factory()`` under ``torch.device("meta")``: no tensor gets storage. It records how
construction wrote each module's tensors, operation by operation (``meta_record``), as each module's steps in the
whole build's order (``meta_steps``): every in-place write (``reset_parameters``, a re-initialization after it,
``.data.zero_()``), the factory that made a tensor (``torch.ones``, ``torch.randn``), ``torch.nn.init`` calls that skip
meta tensors, and a Hugging Face ``post_init``'s ``_init_weights``. A dry run then makes every step once, in that
order, from the generator's state, on temporary full-size tensors of its one module, to learn the generator's state
before each. ``InitReplay.materialize_module`` then initializes any module, in any order (FSDP1 asks unit by unit),
from its recorded states: the values of the model built whole under the same seed, parameters and buffers, with at
most one module's full tensors held beside the shards at any time.

The contract: equal to the whole build to the bit, or refused. ``build_on_meta`` raises ``NotReplayable`` naming the
module (qualified name and class) and the reason when a tensor's value is computed in ``__init__`` from other tensors,
a write reads a tensor made during construction, a draw uses a generator of its own, random numbers are drawn from
computed values, tensors are shared between modules (tied weights), or construction reseeds the generator; the
caller then builds the model whole. ``materialize_module`` raises it rather than leave a tensor unset.

The record is kept by qualified module name, so a module swapped in under the same name keeps its steps
(``nn.SyncBatchNorm.convert_sync_batchnorm`` reuses the tensors): ``InitReplay.bind(model)`` names the live modules
after such a swap, before a wrapper renames them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from hydraddp.parallel.meta_record import NotReplayable, View, record
from hydraddp.parallel.meta_scratch import GeneratorStates, NoMetaOperands, Scratch
from hydraddp.parallel.meta_steps import HFStep, InitRecord, ModuleRecord, describe, own_tensors, resolve

__all__ = ["InitReplay", "NotReplayable", "build_on_meta", "replay_of", "shared_tensors"]

# Wrappers put their module under these names (FSDP1, activation checkpointing, torch.compile): not the model's own.
_WRAPPER_NAMES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
_UNSET = "is not set by any reset_parameters() or Hugging Face _init_weights"


def unwrapped_name(name: str) -> str:
    """A module's name without the wrappers' own levels (FSDP1's, a checkpoint's, compile's)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


@dataclass
class InitReplay:
    """Each module's initialization steps (by qualified name) with the generator state each one starts from."""

    records: dict[str, ModuleRecord] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)  # names of the modules materialized
    names: dict[int, str] = field(default_factory=dict)  # id(live module) -> its name in the record

    def bind(self, model: nn.Module) -> None:
        """Name ``model``'s live modules: after replacing modules (SyncBatchNorm conversion), before wrapping.
        Also attaches the replay to ``model`` (``replay_of``)."""
        self.names = {id(m): unwrapped_name(n) for n, m in model.named_modules()}
        for module_name, module in model.named_modules():
            name = unwrapped_name(module_name)
            if name in self.records:
                _check_live(name, module, self.records[name], own_tensors(module))
            else:  # refused now, while its tensors are still meta (after sharding they are storage of no value)
                _refuse_unrecorded(name, module, own_tensors(module))
        object.__setattr__(model, REPLAY_ATTR, self)  # not a submodule: a plain attribute

    def materialize_module(self, module: nn.Module, device: torch.device | str = "cpu") -> None:
        """Give ``module``'s own tensors their initial values (and storage on ``device`` where they are meta); once per
        module. A sharded parameter (a DTensor, after ``fully_shard`` and ``to_empty``) gets this rank's part of the
        full value. The generator is left as it was."""
        own = own_tensors(module)
        name = self.names.get(id(module))
        if not own or name in self.done:
            return
        if name is None or name not in self.records:
            _refuse_unrecorded(name or "", module, own)
            return
        values = _values(name, module, self.records[name], own)
        self.done.add(name)
        for tensor_name, value in values.items():
            _store(module, tensor_name, own[tensor_name], value, device)

    def materialize(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        """Every module of ``model`` not materialized yet (one swapped in under a recorded name too)."""
        for module_name, module in model.named_modules():
            self.names.setdefault(id(module), unwrapped_name(module_name))
            self.materialize_module(module, device)


def _refuse_unrecorded(name: str, module: nn.Module, own: dict[str, torch.Tensor]) -> None:
    unset = [n for n, t in own.items() if _unset(t)]
    if unset:
        raise NotReplayable(f"{describe(name, type(module), unset[0])} has no storage and no recorded "
                            "initialization: it was not in the model build_on_meta built (a module added or swapped "
                            "in later under another name). Call replay.bind(model) after swapping modules, or build "
                            "the model whole (model.init_device=cpu)")


def _unset(tensor: torch.Tensor) -> bool:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard
    return tensor.is_meta or local.is_meta


def _check_class(name: str, module: nn.Module, recorded: ModuleRecord | None) -> None:
    """A Hugging Face ``_init_weights`` step chooses what to do by the module's class: it is the recorded one's."""
    for _, step in recorded.steps if recorded is not None else ():
        if isinstance(step, HFStep) and not isinstance(module, step.module_class):
            raise NotReplayable(
                f"{describe(name, type(module))} replaced a {step.module_class.__name__} after build_on_meta, and "
                f"Hugging Face's _init_weights initializes a module by its class. Swap it inside the factory given "
                "to build_on_meta, or build the model whole (model.init_device=cpu)")


def _check_live(name: str, module: nn.Module, recorded: ModuleRecord, own: dict[str, torch.Tensor]) -> None:
    _check_class(name, module, recorded)
    for tensor_name, tensor in own.items():
        if tensor_name not in recorded.tensors:
            if _unset(tensor):
                raise NotReplayable(f"{describe(name, type(module), tensor_name)} has no storage and was not in "
                                    "the model build_on_meta built; build the model whole (model.init_device=cpu)")
        elif tuple(tensor.shape) != recorded.tensors[tensor_name][1].size:
            raise NotReplayable(f"{describe(name, type(module), tensor_name)} has the shape {tuple(tensor.shape)}, "
                                f"built as {recorded.tensors[tensor_name][1].size}: changed after build_on_meta")


def _values(name: str, module: nn.Module, recorded: ModuleRecord,
            own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full values of ``module``'s recorded tensors, on the CPU in the dtype it was built in (a model cast after
    building, bf16-true, drew as built): its steps run on fresh storages filled with NaN bytes."""
    _check_live(name, module, recorded, own)
    bases = [torch.full((n,), 0xFF, dtype=torch.uint8) for n in recorded.storages]
    views = recorded.views(bases)
    saved = torch.get_rng_state()
    try:
        # On the CPU, whatever the device: the whole build drew from the CPU generator, whose states are recorded.
        with _installed(module, views, own), torch.no_grad(), _failures_named(name, type(module)):
            for state, step in recorded.steps:
                torch.set_rng_state(state)
                step.run(module, bases)
    finally:
        torch.set_rng_state(saved)
    for tensor_name, view in views.items():
        if View.of(view).is_floating and _any_unwritten(view):
            raise NotReplayable(f"{describe(name, type(module), tensor_name)} still holds the NaN it was filled "
                                "with after its recorded steps: its initialization was not recorded whole")
    # A tensor that lay in a larger storage is copied out, so that it does not keep the rest alive.
    return {n: v if v.untyped_storage().nbytes() == v.numel() * v.element_size() else v.clone()
            for n, v in views.items() if n in own}


@contextlib.contextmanager
def _failures_named(name: str, module_class: type | None) -> Iterator[None]:
    """A step that fails on the real tensors (it ran on meta ones while the model was built) is a NotReplayable
    naming its module: under model.init_device=auto the model is then built whole."""
    try:
        yield
    except NotReplayable:
        raise
    except Exception as exc:
        raise NotReplayable(f"{describe(name, module_class)}: its recorded initialization fails when made again: "
                            f"{type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _installed(module: nn.Module | None, views: dict[str, torch.Tensor],
               own: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s own tensors replaced, for the block, by ``views`` (a Hugging Face step finds them by name)."""
    if module is None:
        yield
        return
    saved_params, saved_buffers = dict(module._parameters), dict(module._buffers)
    for name, view in views.items():
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(view, requires_grad=own[name].requires_grad)
        elif name in module._buffers:
            module._buffers[name] = view
    try:
        yield
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


class _Coverage:
    """Which elements of each module tensor some step wrote (the union over steps): a floating tensor is filled with
    NaN, which a step that writes nothing (or ``mul_`` alone) leaves; an integer or bool one is run twice, from the
    same generator state, with its lowest and highest value: where the two runs differ, nothing wrote it."""

    def __init__(self) -> None:
        self.covered: set[tuple[str, str]] = set()
        self.partial: dict[tuple[str, str], torch.Tensor] = {}  # only tensors no single run wrote whole

    def floating(self, name: str, views: dict[str, torch.Tensor]) -> None:
        for tensor_name, view in views.items():
            if (name, tensor_name) not in self.covered:
                whole = not _any_unwritten(view)
                self._union((name, tensor_name), whole, lambda view=view: ~torch.isnan(view))

    def integral(self, name: str, runs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for tensor_name, (low, high) in runs.items():
            if (name, tensor_name) not in self.covered:
                self._union((name, tensor_name), torch.equal(low, high), lambda low=low, high=high: low == high)

    def _union(self, key: tuple[str, str], whole: bool, written: Callable[[], torch.Tensor]) -> None:
        if whole:
            self.covered.add(key)
            self.partial.pop(key, None)
            return
        now = written()
        if not now.any():
            return
        mask = self.partial[key] = now if key not in self.partial else self.partial[key] | now
        if mask.all():
            self.covered.add(key)
            del self.partial[key]

    def refuse_uncovered(self, record: InitRecord) -> None:
        for name, recorded in record.records.items():
            missing = [t for t in recorded.tensors if (name, t) not in self.covered]
            if missing and recorded.cls is not None:
                where = ", ".join(f"{name}.{t}" if name else t for t in missing)
                raise NotReplayable(f"{where} ({recorded.cls.__name__}) {_UNSET} (nor by any other write while it "
                                    "was built): its value is made in __init__ from other tensors, which a build "
                                    "on the meta device does not have")


def _lowest_highest(dtype: torch.dtype) -> tuple[bool | int, bool | int]:
    if dtype == torch.bool:
        return False, True
    info = torch.iinfo(dtype)
    return info.min, info.max


def _dry_run(record: InitRecord) -> None:
    """Every step once, in the whole build's order from the generator's state now, on temporary storages of one
    module at a time: records each step's generator state, and refuses what no step sets."""
    scratch = Scratch(max((Scratch.nbytes_for(r.storages) for r in record.records.values()), default=0))
    coverage, states = _Coverage(), GeneratorStates()
    for name, group in itertools.groupby(record.order, key=lambda item: item[0]):
        _dry_run_module(name, record.records[name], record.modules.get(name), [s for _, s in group], scratch,
                        coverage, states)
    coverage.refuse_uncovered(record)


def _dry_run_module(name: str, recorded: ModuleRecord, module: nn.Module | None, steps: list, scratch: Scratch,
                    coverage: _Coverage, states: GeneratorStates) -> None:
    """One run of consecutive steps of one module (twice, with its integer tensors filled low then high)."""
    integral = [t for t, (_, view) in recorded.tensors.items() if not view.is_floating]
    start, end, low = torch.get_rng_state(), None, {}
    own = own_tensors(module) if module is not None else {}
    for fill in (0, 1) if integral else (0,):
        torch.set_rng_state(start)
        bases = scratch.bases(recorded.storages)
        views = recorded.views(bases)
        for tensor_name in integral:
            views[tensor_name].fill_(_lowest_highest(views[tensor_name].dtype)[fill])
        watch = NoMetaOperands()
        with _installed(module, views, own), watch, torch.no_grad(), _failures_named(name, recorded.cls):
            for step in steps:
                if fill == 0 and recorded.cls is not None:
                    recorded.steps.append((states.now(), step))
                step.run(module, bases)
        if watch.touched_meta:
            raise NotReplayable(f"{describe(name, recorded.cls)}: its initialization reads or writes tensors of "
                                "other modules")
        if fill == 0:
            end, low = torch.get_rng_state(), {t: views[t].clone() for t in integral}
            coverage.floating(name, {t: v for t, v in views.items() if t not in integral})
        else:
            if not torch.equal(end, torch.get_rng_state()):
                raise NotReplayable(f"{describe(name, recorded.cls)}: its initialization draws a different number "
                                    "of random values depending on its tensors' earlier values")
            coverage.integral(name, {t: (low[t], views[t]) for t in integral})


def shared_tensors(model: nn.Module) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, tensor in own_tensors(module).items():
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

    >>> torch.manual_seed(0); model, replay = build_on_meta(lambda: nn.Linear(4, 4))  # doctest: +SKIP
    >>> replay.materialize(model)  # the values nn.Linear(4, 4) has after torch.manual_seed(0)  # doctest: +SKIP
    """
    start = torch.get_rng_state()
    model, log = record(factory)
    shared = shared_tensors(model)
    if shared:
        names = next(iter(shared.values()))
        raise NotReplayable(f"{' and '.join(names)} are one tensor (tied weights): they are initialized as one")
    init_record = resolve(model, log)
    del log  # the construction's temporaries: only their sizes were needed
    torch.set_rng_state(start)
    try:
        _dry_run(init_record)
    except NotReplayable:
        torch.set_rng_state(start)
        raise
    replay = InitReplay({name: r for name, r in init_record.records.items() if r.cls is not None})
    replay.bind(model)
    return model, replay


def _any_unwritten(value: torch.Tensor) -> bool:
    """Whether a floating tensor still holds its NaN fill somewhere: ``amax`` propagates NaN, in one pass that
    allocates nothing (a mask as large as the tensor, freed between the generator states the dry run keeps, would
    fragment the heap as module-sized tensors do: see ``Scratch``)."""
    if value.numel() == 0:
        return False
    return bool(torch.isnan((torch.view_as_real(value) if value.is_complex() else value).amax()))
