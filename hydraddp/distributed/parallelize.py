"""How fsdp2 makes a model parallel on its device mesh: one step per function, in torchtitan's order.

    parallelize(model, ...)             the steps below, in this order, on the mesh of ``mesh_shape``
      1. apply_tp(model, mesh["tp"])    tensor parallel: ``parallelize_module`` with the model's plan (``tp_plan``)
      2. apply_ac(model, blocks)        activation checkpointing, per block
      3. apply_compile(model, blocks)   ``torch.compile``, per block
      4. apply_fsdp(model, dp_mesh)     ``fully_shard`` per unit, then the root, on ``dp_shard`` (or
                                        ``(dp_replicate, dp_shard)``: HSDP); a meta build is filled after it

TP comes first: its plan names modules as the model wrote them (activation checkpointing adds a level to every
name), and ``fully_shard`` last: it shards whatever each parameter is by then, so a parameter TP split over ``tp``
becomes one DTensor on ``(dp..., tp)``. ``auto_model`` runs ``parallelize`` under fsdp2; every other wrap runs
steps 2 and 3, then its own wrapper (``wrappers``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hydraddp.distributed import meta_init, policies, simulated
from hydraddp.distributed.combinations import ConfigurationError, Problem
from hydraddp.distributed.mesh import MeshShape, data_parallel
from hydraddp.distributed.mesh import build as build_mesh
from hydraddp.distributed.precision import PrecisionSpec, fsdp2_mp_policy
from hydraddp.distributed.report import ROOT
from hydraddp.distributed.wrappers import BATCHNORM_TYPES, broadcast_module_states, pop_policy, remember_replaced


def parallelize(model: nn.Module, device: torch.device, world_size: int, spec: PrecisionSpec, offload: bool, *,
                mesh_shape: Any = None, tp_plan: Mapping[str, Any] | None = None,
                activation_checkpointing: bool = False, compile: bool = False,
                **kwargs: Any) -> tuple[nn.Module, list[str], list[str]]:
    """``model`` made parallel on the mesh of ``mesh_shape`` (``MeshShape.of``; none: ``dp_shard`` = the world, as
    ignite's fsdp2). ``tp_plan``: the TP plan to use instead of the model's own. ``kwargs`` go to ``fully_shard``,
    plus the unit policy keys (``block_classes``...) and a user's own ``mesh=`` (1-D, data parallel only).
    Returns the model, its checkpointed blocks and its compiled modules."""
    from torch.distributed.tensor import DTensor

    shape = MeshShape.of(mesh_shape).resolved(world_size)
    before = [p for p in model.parameters() if not isinstance(p, DTensor)]  # a user's own DTensors stay theirs
    dp_mesh, tp_mesh = _meshes(shape, kwargs.pop("mesh", None), device, world_size)
    # Every rank starts from the first rank's weights, before anything splits them (a meta build has none yet: its
    # values are drawn alike on every rank, after sharding).
    broadcast_module_states(model, dp_mesh.get_group() if tp_mesh is None and dp_mesh.ndim == 1 else
                            torch.distributed.group.WORLD, device)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, resolve_tp_plan(model, tp_plan))
    blocks = kwargs.get("block_classes") or policies.declared_blocks(model)
    checkpointed = apply_ac(model, blocks) if activation_checkpointing else []
    compiled = apply_compile(model, blocks) if compile else []
    apply_fsdp(model, dp_mesh, device, spec, offload, **kwargs)
    remember_replaced(before, model)
    return model, checkpointed, compiled


def _meshes(shape: MeshShape, user_mesh: Any, device: torch.device, world_size: int) -> tuple[Any, Any]:
    """The data-parallel mesh FSDP2 shards over, and the TP mesh (None without TP)."""
    if user_mesh is not None:
        if shape.multi_dimensional:
            raise ValueError(f"mesh= (your own DeviceMesh) and mesh_shape={shape.describe()} both say what to shard "
                             "over; pass one of them.")
        return user_mesh, None
    planning = simulated.active()  # a plan's mesh was made before its fake tensors, which cannot make one
    if not shape.multi_dimensional:
        from torch.distributed.device_mesh import init_device_mesh

        return (planning.mesh if planning else init_device_mesh(device.type, (world_size,))), None
    mesh = planning.mesh if planning else build_mesh(shape, device.type)
    return data_parallel(mesh), (mesh["tp"] if shape.tp > 1 else None)


# --- 1. tensor parallel -------------------------------------------------------------------------------------------

def _styles() -> dict[str, Callable[[], Any]]:
    """The plan's style names, as transformers' ``base_model_tp_plan`` writes them, as torch's ``ParallelStyle``s.
    Every one leaves its output a plain tensor (``use_local_output``), as the model's own code expects."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel,  # output features split: each rank computes its heads / its hidden units
        "rowwise": RowwiseParallel,  # input features split, outputs summed over the TP group
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),  # e.g. the LM head's logits
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # the vocabulary split
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    }


def declared_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The model's own TP plan: its ``tp_plan`` (a mapping, or a method returning one), or a transformers model's
    ``_tp_plan`` (its class's plan plus its config's ``base_model_tp_plan``, with the base model's prefix)."""
    own = getattr(model, "tp_plan", None)
    own = own() if callable(own) else own
    return dict(own or getattr(model, "_tp_plan", None) or {}) or None


def resolve_tp_plan(model: nn.Module, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{module pattern: ParallelStyle}`` for ``parallelize_module``: ``given`` (``wrap.tp_plan``), else the model's
    own; style names (``colwise``...) made torch's styles. A ``ConfigurationError`` when there is none, or a name is
    not a style."""
    # str: a config's {0: colwise} (an nn.Sequential's child) comes with an int key
    plan = {str(key): style for key, style in given.items()} if given else declared_tp_plan(model)
    if not plan:
        raise ConfigurationError(Problem(
            ("mesh.tp", "wrap.tp_plan"),
            f"mesh.tp>1 splits each layer as the model's tensor-parallel plan says, and {type(model).__name__} "
            "declares none (no tp_plan, no transformers base_model_tp_plan).",
            "Give a plan: wrap.tp_plan='{layers.*.attn.q: colwise, layers.*.attn.out: rowwise}' (auto_model: "
            "tp_plan=...), or a tp_plan attribute on the model; or set mesh.tp=1."))
    styles = _styles()
    resolved = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in styles:
                raise ConfigurationError(Problem(
                    ("wrap.tp_plan",), f"the TP plan gives {pattern!r} the style {style!r}, which hydraddp does not "
                    "know.", f"Use one of: {', '.join(styles)}; or a torch ParallelStyle in the model's tp_plan."))
            style = styles[style]()
        resolved[pattern] = style
    return resolved


def apply_tp(model: nn.Module, tp_mesh: Any, plan: Mapping[str, Any]) -> None:
    """Split ``model``'s layers over ``tp_mesh`` as ``plan`` says (``parallelize_module``; ``*`` matches one name)."""
    from torch.distributed.tensor.parallel import parallelize_module

    # A parameter TP splits and FSDP then shards lives on the 2-D (dp_shard, tp) mesh; reducing its gradient norm
    # takes one all-reduce per dimension, which DTensor warns about at every step. That cost is the design's.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    parallelize_module(model, tp_mesh, dict(plan))


def tp_problems(model: nn.Module, tp: int, given: Mapping[str, Any] | None = None) -> list[Problem]:
    """What keeps ``model`` (built on the meta device is enough) from splitting ``tp`` ways: no plan, a plan entry
    that matches no module, or a size the plan splits that ``tp`` does not divide (features, vocabulary, heads and
    KV heads, and the sequence under sequence parallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    try:
        plan = resolve_tp_plan(model, given)
    except ConfigurationError as exc:
        return list(exc.problems)
    found: list[Problem] = []
    fix = "Choose a mesh.tp that divides it, or mesh.tp=1."
    for pattern, style in plan.items():
        modules = [(name, m) for name, m in model.named_modules() if _matches(name, pattern)]
        if not modules:
            found.append(Problem(("wrap.tp_plan",), f"the TP plan's entry {pattern!r} matches no module of "
                                 f"{type(model).__name__}.", "Name modules as model.named_modules() does."))
        for name, module in modules[:1]:  # the pattern's modules are alike (layers.*.x)
            split = _split_size(module, style, ColwiseParallel, RowwiseParallel)
            if split is not None and split[1] % tp:
                found.append(Problem(("mesh.tp",), f"mesh.tp={tp} does not divide {name}'s {split[0]} "
                                     f"({split[1]}), which the TP plan splits ({pattern}).", fix))
    config = getattr(model, "config", None)
    for source, key in [(config, "num_attention_heads"), (config, "num_key_value_heads"),
                        *((m, "heads") for m in model.modules())]:
        value = getattr(source, key, None)
        if isinstance(value, int) and value % tp:
            found.append(Problem(("mesh.tp",), f"mesh.tp={tp} does not divide the model's {key}={value}: each TP "
                                 "rank computes whole heads.", fix))
            break
    seq_len = getattr(model, "seq_len", None)
    if any(isinstance(s, SequenceParallel) for s in plan.values()) and isinstance(seq_len, int) and seq_len % tp:
        found.append(Problem(("mesh.tp", "data.seq_len"), f"mesh.tp={tp} does not divide the sequence length "
                             f"{seq_len}, which sequence parallelism splits.", fix))
    return found


def _matches(name: str, pattern: str) -> bool:
    """``parallelize_module``'s rule: the same number of dotted parts, each matched alone (``*``: one part)."""
    import fnmatch

    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms))


def _split_size(module: nn.Module, style: Any, colwise: type, rowwise: type) -> tuple[str, int] | None:
    """The size ``style`` splits in ``module``: (its name, its value)."""
    if isinstance(module, nn.Linear):
        if isinstance(style, colwise):
            return "out_features", module.out_features
        if isinstance(style, rowwise):
            return "in_features", module.in_features
    if isinstance(module, nn.Embedding):
        if isinstance(style, rowwise):
            return "num_embeddings", module.num_embeddings
        if isinstance(style, colwise):
            return "embedding_dim", module.embedding_dim
    return None


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
        return [ROOT]
    return [name.replace("._checkpoint_wrapped_module", "") for name in names]


# --- 4. fully_shard -----------------------------------------------------------------------------------------------

def apply_fsdp(model: nn.Module, dp_mesh: Any, device: torch.device, spec: PrecisionSpec, offload: bool,
               **kwargs: Any) -> None:
    """``fully_shard`` on BatchNorms (fp32), each unit, then the root, over ``dp_mesh``; a model built on the meta
    device then gets its shards' storage and values. ``kwargs``: the unit policy keys, then ``fully_shard``'s."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = pop_policy(kwargs)
    user_mp = kwargs.pop("mp_policy", None)
    offload_policy = kwargs.pop("offload_policy", None) or (CPUOffloadPolicy() if offload else OffloadPolicy())
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
    for name in policies.plan_units(model, policy, skip=is_sharded):
        module = model.get_submodule(name)
        if not is_sharded(module):
            fully_shard(module, mp_policy=unit_mp, **common)
    if not is_sharded(model):
        fully_shard(model, mp_policy=root_mp, **common)
    replay = meta_init.replay_of(model)
    if replay is not None:
        # Built on the meta device: each rank now allocates its shards only, then fills them module by module
        # (one module's full tensors at a time; every rank draws the same values, so nothing is sent).
        model.to_empty(device="cpu" if offload else device)
        replay.materialize(model, device)
