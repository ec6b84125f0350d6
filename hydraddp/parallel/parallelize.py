"""How a model is spread over ranks: one pipeline for every wrap, driven by one ``Layout``.

    auto_model = validate (combinations) -> layout (Layout.of) -> parallelize -> record (WrapRecord)

    parallelize(model, layout), in this order:
      0. prepare               SyncBatchNorm (names and tensors kept, so a meta build's record stays valid), the
                               device, the precision's weight cast and hooks
      1. apply_tp              tensor parallel over mesh["tp"] (fsdp2 with tp > 1; ``tp.py``)
      2. apply_ac              activation checkpointing, per block
      3. apply_compile         ``torch.compile``: per block under fsdp2, the whole model otherwise
      4. apply_<wrap>          ``fully_shard`` (fsdp2, below), FSDP1, DDP, DataParallel, Horovod, or nothing
                               (``wrappers``)
      5. materialize           a meta build's values: after sharding, each rank its shards (fsdp2; FSDP1 fills each
                               unit as it wraps it); before step 1 under the wraps that need whole tensors

TP comes first: its plan names modules as the model wrote them (activation checkpointing adds a level to every
name), and ``fully_shard`` last: it shards whatever each parameter is by then, so a parameter TP split over ``tp``
becomes one DTensor on ``(dp..., tp)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hydraddp.parallel import meta_init, policies, simulation, wrappers
from hydraddp.parallel.combinations import ConfigurationError, Problem
from hydraddp.parallel.mesh import DIMS, data_parallel
from hydraddp.parallel.mesh import build as build_mesh
from hydraddp.parallel.layout import AUTOCAST_WRAPS, SYNC_BN_WRAPS, Layout
from hydraddp.parallel.precision import add_precision_hooks, fsdp2_mp_policy
from hydraddp.parallel.tp import apply_tp, resolve_tp_plan
from hydraddp.parallel.wrappers import BATCHNORM_TYPES, broadcast_module_states, remember_replaced

log = logging.getLogger(__name__)


def parallelize(model: nn.Module, layout: Layout) -> tuple[nn.Module, list[str], list[str]]:
    """``model`` made parallel as ``layout`` says. Returns the model, its checkpointed blocks and its compiled modules."""
    from torch.distributed.tensor import DTensor

    model = prepare(model, layout)
    before = [p for p in model.parameters() if not isinstance(p, DTensor)]  # a user's own DTensors stay theirs
    dp_mesh, tp_mesh = _meshes(layout) if layout.wrap == "fsdp2" else (None, None)
    if layout.wrap == "fsdp2":
        # Every rank starts from the first rank's weights, before anything splits them (a meta build has none yet:
        # its values are drawn alike on every rank, after sharding). The other wrappers broadcast for themselves.
        for group in _broadcast_groups(layout, dp_mesh, tp_mesh):
            broadcast_module_states(model, group, layout.device)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, resolve_tp_plan(model, layout.tp_plan))
    # FSDP1: inside its units, after wrapping (torch's order): a checkpoint wrapper around a unit hides the unit's
    # flat parameter from DCP's names, and a resume found no optimizer state for it.
    checkpoint_inside_units = layout.wrap == "fsdp"
    checkpointed = apply_ac(model, layout.blocks) if layout.activation_checkpointing and not checkpoint_inside_units else []
    compiled = apply_compile(model, layout.blocks if layout.wrap == "fsdp2" else ()) if layout.compile else []
    model = apply_fsdp2(model, layout, dp_mesh) if layout.wrap == "fsdp2" else WRAPPERS[layout.wrap](model, layout)
    materialize(model, layout)
    if layout.activation_checkpointing and checkpoint_inside_units:
        checkpointed = [meta_init.unwrapped_name(name) for name in apply_ac(model, layout.blocks)]
    remember_replaced(before, model)
    return model, checkpointed, compiled


WRAPPERS: dict[str, Callable[[nn.Module, Layout], nn.Module]] = {
    "none": wrappers.apply_none, "dp": wrappers.apply_dp, "ddp": wrappers.apply_ddp, "fsdp": wrappers.apply_fsdp,
    "horovod": wrappers.apply_horovod}


# --- 0. prepare ---------------------------------------------------------------------------------------------------

def prepare(model: nn.Module, layout: Layout) -> nn.Module:
    """SyncBatchNorm, then (a meta build under a wrap that needs whole tensors) the values, the device, the
    precision's weight dtype and its hooks: on the model itself, before wrapping, since the wrappers call it,
    DataParallel's replicas copy its hooks, and the FSDPs cast for themselves (their outputs still come back in fp32
    from these hooks)."""
    if layout.sync_bn and layout.wrap in SYNC_BN_WRAPS:
        log.info("Converting BatchNorm to SyncBatchNorm")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    replay = meta_init.replay_of(model)
    if replay is not None:
        replay.bind(model)  # by module name, after the swap above, before a wrapper renames them
    if not layout.shards:
        materialize(model, layout)
        if not all(p.device == layout.device for p in model.parameters()):
            model.to(layout.device)  # FSDP moves each unit as it shards it (and keeps it on the CPU under offload)
    if layout.precision.storage_dtype != torch.float32:
        model.to(layout.precision.storage_dtype)  # bf16-true: the weights themselves are bf16
    add_precision_hooks(model, layout.precision, layout.device.type, autocast=layout.wrap in AUTOCAST_WRAPS)
    return model


def _meshes(layout: Layout) -> tuple[Any, Any]:
    """The data-parallel mesh FSDP2 shards over, and the TP mesh (None without TP). A user's own mesh (``mesh=``) is
    the data-parallel one, or, when its dimensions are named as ``MeshShape``'s, split by those names (a pipeline
    stage's: the mesh of every stage, whose ``pp`` dimension is not the stage's to shard over)."""
    shape = layout.mesh_shape
    if layout.user_mesh is not None:
        if shape.multi_dimensional:
            raise ValueError(f"mesh= (your own DeviceMesh) and mesh_shape={shape.describe()} both say what to shard "
                             "over; pass one of them.")
        if not _named_as_ours(layout.user_mesh):
            return layout.user_mesh, None
        tp = layout.user_mesh["tp"]
        return data_parallel(layout.user_mesh), (tp if tp.size() > 1 else None)
    planned = simulation.active()  # a plan's mesh was made before its fake tensors, which cannot make one
    if not shape.multi_dimensional:
        from torch.distributed.device_mesh import init_device_mesh

        return (planned.mesh if planned else init_device_mesh(layout.device.type, (layout.world_size,))), None
    mesh = planned.mesh if planned else build_mesh(shape, layout.device.type)
    return data_parallel(mesh), (mesh["tp"] if shape.tp > 1 else None)


def _named_as_ours(mesh: Any) -> bool:
    return set(DIMS) <= set(mesh.mesh_dim_names or ())


def _broadcast_groups(layout: Layout, dp_mesh: Any, tp_mesh: Any) -> list[Any]:
    """The groups that give every rank holding this model the first one's weights: the data-parallel mesh's one
    group; the groups of each dimension in turn on a user's named mesh (the ranks of one pipeline stage, which other
    stages' ranks, holding other modules, are not in); every rank otherwise."""
    if tp_mesh is None and dp_mesh.ndim == 1:
        return [dp_mesh.get_group()]
    if layout.user_mesh is not None:
        return [layout.user_mesh.get_group(name) for name in DIMS if layout.user_mesh[name].size() > 1]
    return [torch.distributed.group.WORLD]


# --- 2. activation checkpointing ----------------------------------------------------------------------------------

def apply_ac(model: nn.Module, blocks: Iterable[type | str]) -> list[str]:
    """Activation checkpointing on each block (``blocks``: the FSDP units' classes, or the model's own declaration,
    ``fsdp_block_classes`` or ``_no_split_modules``). Returns the blocks' names."""
    blocks = tuple(blocks)
    if not blocks:
        raise ConfigurationError(Problem(
            ("activation_checkpointing",),
            f"activation checkpointing works per block, and {type(model).__name__} declares none "
            "(no fsdp_block_classes, no _no_split_modules).",
            "Name the blocks: block_classes=['MyBlock'] (the app: +wrap.kwargs.block_classes=[MyBlock]), "
            "or turn activation checkpointing off."))
    names = policies.checkpoint_blocks(model, blocks)
    if not names:
        raise ConfigurationError(Problem(
            ("activation_checkpointing",),
            f"activation checkpointing found no block of {list(blocks)} in {type(model).__name__}.",
            "Name block classes the model really has, or turn activation checkpointing off."))
    return names


# --- 3. compile ---------------------------------------------------------------------------------------------------

def apply_compile(model: nn.Module, blocks: Iterable[type | str]) -> list[str]:
    """``torch.compile`` on each block (torchtitan's rule under fsdp2: each compiled graph stays inside one unit,
    whose all-gathers run outside it), or on the whole model when ``blocks`` is empty (under ddp: the module DDP
    calls, so its gradient hooks run as each compiled backward accumulates). Returns the compiled modules' names."""
    blocks = tuple(blocks)
    names = policies.compile_blocks(model, blocks) if blocks else []
    if not names:
        policies.compile_module(model)
        return [policies.ROOT]
    return [name.replace("._checkpoint_wrapped_module", "") for name in names]


# --- 4. fully_shard -----------------------------------------------------------------------------------------------

def apply_fsdp2(model: nn.Module, layout: Layout, dp_mesh: Any) -> nn.Module:
    """``fully_shard`` on BatchNorms (fp32), each unit, then the root, over ``dp_mesh``. The layout's ``wrapper_kwargs``
    go to ``fully_shard``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = dict(layout.wrapper_kwargs)
    spec = layout.precision
    user_mp = kwargs.pop("mp_policy", None)
    offload_policy = kwargs.pop("offload_policy", None) or (CPUOffloadPolicy() if layout.offload else OffloadPolicy())
    common = {"mesh": dp_mesh, "offload_policy": offload_policy, **kwargs}
    unit_mp = user_mp or fsdp2_mp_policy(spec)
    # The root returns fp32 outputs in mixed modes, so the loss is computed in fp32 as under autocast.
    root_mp = user_mp or fsdp2_mp_policy(spec, output_dtype=torch.float32 if spec.is_mixed else None)

    def is_sharded(module: nn.Module) -> bool:
        return isinstance(module, FSDPModule)

    if spec.is_mixed and user_mp is None:
        # BatchNorm in reduced precision drifts; the known fix is its own unit computing in fp32 (inputs cast
        # up), whose output is cast back to the compute dtype for the next layer.
        bn_mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=spec.compute_dtype)
        for module in model.modules():
            if isinstance(module, BATCHNORM_TYPES) and not is_sharded(module) and any(True for _ in module.parameters()):
                fully_shard(module, mp_policy=bn_mp, **common)
    units = list(policies.plan_units(model, layout.units, skip=is_sharded))
    for name in units:
        module = model.get_submodule(name)
        # torchtitan's rule: the last unit keeps its parameters gathered after forward, since backward starts with it
        # (resharding would only gather them again at once). The root keeps its own gathered too (fully_shard's rule).
        last = {"reshard_after_forward": False} if name == units[-1] and "reshard_after_forward" not in kwargs else {}
        if not is_sharded(module):
            fully_shard(module, mp_policy=unit_mp, **common, **last)
    if not is_sharded(model):
        fully_shard(model, mp_policy=root_mp, **common)
    return model


# --- 5. materialize -----------------------------------------------------------------------------------------------

def materialize(model: nn.Module, layout: Layout) -> None:
    """A model built on the meta device (``meta_init.build_on_meta``) gets its values, the whole build's: whole
    (before a wrapper that needs whole tensors), or, after ``fully_shard``, each rank allocates its shards only and
    fills them module by module (one module's full tensors at a time; every rank draws the same values, so nothing is
    sent). Nothing to do for a model that holds no meta tensor (FSDP1 filled its units as it wrapped them)."""
    replay = meta_init.replay_of(model)
    if replay is None:
        return
    if layout.wrap == "fsdp2":
        model.to_empty(device="cpu" if layout.offload else layout.device)
    replay.materialize(model, layout.device)
