"""A launch's device mesh: pipeline stages x data-parallel replicas x data-parallel shards x tensor-parallel ranks.

``MeshShape(dp_replicate, dp_shard, tp, pp)`` is what the config says (``mesh.*``; ``dp_shard=-1``: the ranks left),
and ``build`` makes torch's ``DeviceMesh`` of it, with those dimension names, innermost last (a TP group is
consecutive ranks, so that it stays within a node; the pipeline's stages are outermost, torchtitan's order). FSDP2
shards over ``dp_shard`` and, with ``dp_replicate > 1``, replicates over ``dp_replicate`` (HSDP, ``fully_shard`` on
the 2-D mesh). Today's 1-D fsdp2 is the shape ``(1, world, 1)``. Without pipeline stages (``pp=1``) the mesh, its
description and its coordinates have no ``pp`` dimension at all: what a run without one records is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DIMS = ("dp_replicate", "dp_shard", "tp")
PIPELINED_DIMS = ("pp", *DIMS)  # with pipeline stages (pp > 1)


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the ranks left
    tp: int = 1
    pp: int = 1  # pipeline stages' places (outermost)

    @property
    def dims(self) -> tuple[str, ...]:
        """The dimensions this mesh has, outermost first: ``pp`` only with pipeline stages."""
        return PIPELINED_DIMS if self.pp > 1 else DIMS

    def resolved(self, world_size: int) -> MeshShape:
        """``dp_shard=-1`` made the ranks left; a ``ValueError`` when the degrees cannot make ``world_size``."""
        for name in PIPELINED_DIMS:
            value = getattr(self, name)
            if value < 1 and not (name == "dp_shard" and value == -1):
                raise ValueError(f"mesh.{name}={value}: a degree is at least 1 (mesh.dp_shard=-1: the ranks left)")
        shard = self.dp_shard
        if shard == -1:
            fixed = self.pp * self.dp_replicate * self.tp
            if world_size % fixed:
                named = " x ".join(f"mesh.{name}={getattr(self, name)}" for name in self.dims if name != "dp_shard")
                raise ValueError(f"{named} = {fixed} does not divide the world size {world_size}, so "
                                 "mesh.dp_shard=-1 has no value")
            shard = world_size // fixed
        resolved = MeshShape(self.dp_replicate, shard, self.tp, self.pp)
        if resolved.size != world_size:
            raise ValueError(f"mesh {resolved.describe()} is {resolved.size} ranks, but the world size is "
                             f"{world_size}")
        return resolved

    @property
    def size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many ranks read different batches (a TP group reads one)."""
        return self.dp_replicate * self.dp_shard

    @property
    def multi_dimensional(self) -> bool:
        return self.dp_replicate > 1 or self.tp > 1 or self.pp > 1

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """``rank``'s place in the (resolved) mesh: ([stage place,] replica, shard, TP rank); the TP rank varies
        fastest."""
        place = (rank // (self.dp_replicate * self.dp_shard * self.tp),) if self.pp > 1 else ()
        within = rank % (self.dp_replicate * self.dp_shard * self.tp)
        return (*place, within // (self.dp_shard * self.tp), within // self.tp % self.dp_shard, within % self.tp)

    def label(self) -> str:
        """``2x2x1``: the degrees in the order of ``dims`` (the compare table's and the plan's column)."""
        return "x".join(str(getattr(self, name)) for name in self.dims)

    def data_parallel_rank(self, rank: int) -> int:
        """Which share of each batch ``rank`` reads: the ranks of one TP group read the same one, and so do the
        stages of one pipeline (the first reads the inputs, the last the targets)."""
        return rank // self.tp % (self.dp_replicate * self.dp_shard)

    def describe(self) -> str:
        """``dp_replicate=2,dp_shard=2,tp=1`` (``pp=2,...`` first with pipeline stages): the ``hydraddp.mesh``
        tag."""
        return ",".join(f"{name}={getattr(self, name)}" for name in self.dims)

    @classmethod
    def parse(cls, described: str) -> MeshShape:
        """The inverse of ``describe``."""
        return cls(**{name: int(value) for name, value in (part.split("=") for part in described.split(","))})

    @classmethod
    def of(cls, value: Any) -> MeshShape:
        """A ``MeshShape`` from one, a mapping of the dimension names, or a ``(dp_replicate, dp_shard, tp[, pp])``
        tuple."""
        if value is None or isinstance(value, MeshShape):
            return value or cls()
        if isinstance(value, dict) or hasattr(value, "keys"):
            return cls(**{name: int(value[name]) for name in PIPELINED_DIMS if name in value})
        return cls(*(int(v) for v in value))


def realized(shape: MeshShape, wrap: str, world_size: int) -> MeshShape | None:
    """The mesh ``wrap`` runs on: ``shape`` resolved under fsdp2 or with pipeline stages, every rank a replica under
    ddp, none otherwise."""
    if wrap == "fsdp2" or shape.pp > 1:
        return shape.resolved(world_size)
    return MeshShape(world_size, 1, 1) if wrap == "ddp" else None


def build(shape: MeshShape, device_type: str) -> Any:
    """torch's ``DeviceMesh`` of ``shape`` (resolved), its dimensions named as ``shape.dims``."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(getattr(shape, name) for name in shape.dims),
                            mesh_dim_names=shape.dims)


def data_parallel(mesh: Any) -> Any:
    """The mesh FSDP2 shards over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP."""
    return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
