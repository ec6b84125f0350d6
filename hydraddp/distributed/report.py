"""WrapReport: what the wrapping actually did, measured from this rank's tensors."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from hydraddp.distributed import utils
from hydraddp.parallel.policies import ROOT
from hydraddp.parallel.precision import PrecisionSpec, precision_spec

_WRAPPER_LEVELS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")  # FSDP1, activation checkpointing


@dataclass(frozen=True)
class WrapRecord:
    """What auto_model decided, kept on the model so wrap_report can tell it later."""

    wrap: str
    precision: PrecisionSpec
    offload: str
    total_numel: int
    checkpointed: tuple[str, ...] = ()  # blocks under activation checkpointing
    compiled: tuple[str, ...] = ()  # modules under torch.compile (ROOT: the whole model)
    init_device: str = "cpu"  # where the model was built: "meta" (meta_init: sharded first, then filled) or a device
    mesh: str | None = None  # the data-parallel mesh (mesh.MeshShape.describe): fsdp2 and ddp
    trainable_numel: int | None = None  # of total_numel, the parameters that require grad (None: all of them)


@dataclass
class WrapReport:
    """The realized wrapping and this rank's shard sizes (bytes, not GiB).

    >>> report = idist.wrap_report(model, optimizer)  # doctest: +SKIP
    >>> every_rank = report.gather()  # one WrapReport per rank, on every rank  # doctest: +SKIP
    """

    wrapper: str
    backend: str | None
    world_size: int
    rank: int
    mesh_shape: list[int] | None
    units: list[str]
    precision: str
    param_dtype: str
    reduce_dtype: str
    storage_dtype: str
    offload: str
    total_numel: int
    local_numel: int
    param_bytes: int
    grad_bytes: int
    optim_state_bytes: int
    checkpointed: list[str] = field(default_factory=list)  # blocks whose activations are recomputed in backward
    compiled: list[str] = field(default_factory=list)  # modules under torch.compile ("<root>": the whole model)
    init_device: str = "cpu"  # "meta": built on the meta device and filled after sharding (meta_init)
    mesh: str | None = None  # "dp_replicate=2,dp_shard=2,tp=1": the mesh the model is wrapped on (fsdp2, ddp)
    mesh_coordinate: list[int] | None = None  # this rank's place in the mesh: [replica, shard, TP rank] (fsdp2)
    kept_after_forward: list[str] = field(default_factory=list)  # fsdp2 units left gathered from forward to backward
    notes: list[str] = field(default_factory=list)  # what the wrapping costs for nothing here, in words
    # Of total_numel, those that train (requires_grad); the rest are frozen (a LoRA model's base): no gradients, no
    # optimizer state. None: a report from before this was recorded.
    trainable_numel: int | None = None
    use_orig_params: bool | None = None  # fsdp: whether FSDP1 kept the original parameters (frozen ones beside others)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WrapReport:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def gather(self) -> list[WrapReport]:
        """Every rank's report, in rank order. A collective: call it on all ranks."""
        return [WrapReport.from_dict(d) for d in utils.all_gather(self.to_dict())]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # DTensor (FSDP2): this rank's shard
    return to_local() if to_local is not None else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _clean(name: str, under_wrapper: bool = False) -> str:
    """A module name as the user wrote the model: the wrappers' own levels dropped as whole name parts
    (``a.submodule.b`` stays as it is). ``under_wrapper``: the name starts at DDP/DataParallel's ``module``."""
    parts = name.split(".") if name else []
    if under_wrapper and parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_LEVELS) or ROOT


def _realized(model: nn.Module) -> tuple[str, list[str], list[int] | None]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    wrapped = isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))
    fsdp2 = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if fsdp2:
        mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
        return "fsdp2", [_clean(n, wrapped) for n in fsdp2], list(mesh.shape) if mesh is not None else None
    fsdp1 = [name for name, m in model.named_modules() if isinstance(m, FSDP)]
    if fsdp1:
        return "fsdp", [_clean(n, wrapped) for n in fsdp1], [model.process_group.size()] if isinstance(model, FSDP) else None
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp", [ROOT], [model.process_group.size()]
    if isinstance(model, nn.DataParallel):
        return "dp", [ROOT], [len(model.device_ids)]
    return "none", [], None


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    inner = getattr(optimizer, "optimizer", None)  # ZeroRedundancy-style or Horovod-style wrappers
    state = optimizer.state if optimizer.state or inner is None else inner.state
    return sum(_nbytes(v) for per_param in state.values() for v in per_param.values() if isinstance(v, torch.Tensor))


def wrap_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> WrapReport:
    """Report the realized wrapping of ``model`` and this rank's param/grad/optimizer-state bytes.

    Take it after the first optimizer step to see grads and optimizer state.
    """
    record: WrapRecord | None = getattr(model, "_hydraddp_wrap", None)
    wrapper, units, mesh_shape = _realized(model)
    params = list({id(p): p for p in model.parameters()}.values())
    local_numel = sum(_local(p).numel() for p in params)
    storage = _local(params[0]).dtype if params else torch.float32
    if record is not None:
        spec, offload, total = record.precision, record.offload, record.total_numel
        trainable = total if record.trainable_numel is None else record.trainable_numel
        if record.wrap == "horovod":
            wrapper = "horovod"
    else:
        spec = precision_spec("bf16-true" if storage == torch.bfloat16 else "fp32")
        offload, total = "none", sum(p.numel() for p in params)  # DTensor.numel() is the global count
        trainable = sum(p.numel() for p in params if p.requires_grad)
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    return WrapReport(
        wrapper=wrapper,
        backend=utils.backend(),
        world_size=utils.get_world_size(),
        rank=utils.get_rank(),
        mesh_shape=mesh_shape,
        units=units,
        precision=spec.name,
        param_dtype=name(spec.compute_dtype),
        reduce_dtype=name(spec.reduce_dtype),
        storage_dtype=name(storage),
        offload=offload,
        total_numel=total,
        local_numel=local_numel,
        param_bytes=sum(_nbytes(p) for p in params),
        grad_bytes=sum(_nbytes(p.grad) for p in params if p.grad is not None),
        optim_state_bytes=_optimizer_state_bytes(optimizer),
        checkpointed=list(record.checkpointed) if record is not None else [],
        compiled=list(record.compiled) if record is not None else [],
        init_device=record.init_device if record is not None else "cpu",
        mesh=record.mesh if record is not None else None,
        mesh_coordinate=_coordinate(model, record) if wrapper == "fsdp2" else None,
        kept_after_forward=_kept_after_forward(model, wrapped=wrapper == "fsdp2"),
        notes=_notes(wrapper, mesh_shape, record),
        trainable_numel=trainable,
        use_orig_params=getattr(model, "_use_orig_params", None) if wrapper == "fsdp" else None,
    )


def _kept_after_forward(model: nn.Module, wrapped: bool) -> list[str]:
    """fsdp2's units that do not reshard after forward (the last block, as torchtitan does, and the root)."""
    from torch.distributed.fsdp import FSDPModule

    if not wrapped:
        return []
    kept = []
    for name, module in model.named_modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is not None and group.post_forward_mesh_info is None:
            kept.append(_clean(name))
    return kept


def _notes(wrapper: str, mesh_shape: list[int] | None, record: WrapRecord | None) -> list[str]:
    if wrapper not in ("fsdp", "fsdp2") or mesh_shape is None:
        return []
    shards = mesh_shape[-1] if wrapper == "fsdp" or record is None or record.mesh is None else \
        _shard_degree(record.mesh)
    if shards > 1:
        return []
    return [f"wrap={wrapper} over one data-parallel rank shards nothing: every rank holds every parameter, and pays "
            "FSDP's gathers and copies for it; wrap=ddp (or none) runs the same step without them"]


def _shard_degree(mesh: str) -> int:
    from hydraddp.parallel.mesh import MeshShape

    return MeshShape.parse(mesh).dp_shard


def _coordinate(model: nn.Module, record: WrapRecord | None) -> list[int] | None:
    if record is not None and record.mesh is not None:
        from hydraddp.parallel.mesh import MeshShape

        return list(MeshShape.parse(record.mesh).coordinate(utils.get_rank()))
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    coordinate = mesh.get_coordinate() if mesh is not None else None
    return list(coordinate) if coordinate is not None else None
