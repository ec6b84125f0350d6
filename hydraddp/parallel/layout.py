"""The parallel layout: everything ``auto_model`` will do to one model, decided from its arguments before any step runs,
in one small typed description that every step of ``parallelize`` reads (no keyword arguments popped on the way)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hydraddp.parallel.mesh import MeshShape
from hydraddp.parallel.mesh import realized as realized_mesh
from hydraddp.parallel.policies import declared_blocks, resolve_policy
from hydraddp.parallel.precision import PrecisionSpec

SHARDING_WRAPS = ("fsdp", "fsdp2")
AUTOCAST_WRAPS = ("none", "dp", "ddp", "horovod")  # the FSDPs cast for themselves
SYNC_BN_WRAPS = ("ddp", "fsdp", "fsdp2")  # horovod converts to its own SyncBatchNorm as it wraps


@dataclass(frozen=True)
class Layout:
    """How one model is spread over the ranks.

    >>> layout = Layout.of(model, "fsdp2", precision_spec("bf16"), torch.device("cpu"), 2)  # doctest: +SKIP
    """

    wrap: str  # realized: none | dp | ddp | fsdp | fsdp2 | horovod
    precision: PrecisionSpec
    device: torch.device
    world_size: int
    mesh_shape: MeshShape  # resolved against world_size
    mesh: str | None = None  # the mesh the model runs on, described (fsdp2, ddp; None with a user's own mesh)
    offload: bool = False
    sync_bn: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    blocks: tuple[type | str, ...] = ()  # the model's blocks: activation checkpointing, per-block compile
    units: Any = None  # the FSDP unit policy (fsdp, fsdp2), resolved
    tp_plan: Mapping[str, Any] | None = None  # given instead of the model's own (fsdp2 with mesh tp > 1)
    user_mesh: Any = None  # a user's own DeviceMesh (fsdp2): data parallel, or named as MeshShape's dims
    wrapper_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the wrapper's own keywords, as given

    @property
    def shards(self) -> bool:
        return self.wrap in SHARDING_WRAPS

    @classmethod
    def of(cls, model: nn.Module, wrap: str, precision: PrecisionSpec, device: torch.device, world_size: int, *,
           offload: bool = False, sync_bn: bool = False, activation_checkpointing: bool = False,
           compile: bool = False, **kwargs: Any) -> Layout:
        """The layout of ``model`` under the realized ``wrap``. ``kwargs``: ``mesh_shape``, ``tp_plan``, a user's
        ``mesh`` (fsdp2), the unit policy keys (``auto_wrap_policy``, ``block_classes``, ``min_num_params``) and
        the wrapper's own keywords, which are passed on as given."""
        kwargs = dict(kwargs)
        shape = MeshShape.of(kwargs.pop("mesh_shape", None)).resolved(world_size)
        tp_plan = kwargs.pop("tp_plan", None)
        if wrap != "fsdp2":
            _check_one_data_parallel_dimension(shape, wrap, world_size, tp_plan)
        described = None if "mesh" in kwargs else realized_mesh(shape, wrap, world_size)
        user_mesh = kwargs.pop("mesh", None) if wrap == "fsdp2" else None
        blocks = tuple(kwargs.get("block_classes") or declared_blocks(model))
        if wrap in SHARDING_WRAPS:
            units = resolve_policy(kwargs.pop("auto_wrap_policy", None), block_classes=kwargs.pop("block_classes", None),
                                   min_num_params=kwargs.pop("min_num_params", None))
        else:
            units = None
            kwargs.pop("block_classes", None)  # the blocks of activation checkpointing, not the wrapper's
        return cls(wrap, precision, device, world_size, shape, described.describe() if described else None, offload,
                   sync_bn, activation_checkpointing, compile, blocks, units, tp_plan, user_mesh, kwargs)


def _check_one_data_parallel_dimension(shape: MeshShape, wrap: str, world_size: int, tp_plan: Any) -> None:
    """A wrap other than fsdp2 has one data-parallel dimension: DDP replicates over every rank, the others shard or
    replicate as they do. A mesh or a TP plan asking for more is refused, with the reason."""
    if shape.tp > 1 or (shape.dp_replicate not in (1, world_size)) or (shape.dp_replicate > 1 and wrap != "ddp"):
        raise ValueError(f"mesh {shape.describe()} needs wrap=fsdp2 (HSDP and tensor parallel are built on "
                         f"FSDP2's fully_shard and a device mesh); wrap={wrap} has one data-parallel dimension. "
                         "Use wrap=fsdp2, or leave mesh_shape out.")
    if tp_plan:
        raise ValueError(f"tp_plan is for tensor parallel, which needs wrap='fsdp2' and a mesh with tp > 1; "
                         f"wrap={wrap!r} was realized. Drop tp_plan, or use wrap='fsdp2'.")
