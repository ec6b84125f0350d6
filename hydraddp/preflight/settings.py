"""The composed config turned, once, into the typed value the preflight's rules judge.

``complete`` first decides the config's ``auto`` values in place (the backend, the processes per node), for this
machine: what the checks, the plan and the launch all read from then on. ``Settings.of`` then reads the completed
config once into ``Settings``: the config as the schema's dataclasses (``config.schema.Config``, resolved), the world,
the mesh it asks for, and the core's ``Combination`` with this machine's facts (its GPUs, bf16, Horovod, the launcher
that started it). Every rule of ``preflight.config`` and ``preflight.environment`` judges that value; none reads the
DictConfig again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hydraddp.config.schema import Config
from hydraddp.distributed.env import detect_launch_env
from hydraddp.parallel.combinations import Combination, Problem
from hydraddp.parallel.machine import combination, cuda_device_count, nproc_per_node_of
from hydraddp.parallel.mesh import MeshShape

# Where each rule's keys live in the config, so messages name what the user types.
CONFIG_NAMES = {
    "backend": "backend",
    "wrap": "wrap",
    "precision": "precision",
    "offload": "offload",
    "sync_bn": "model.sync_bn",
    "compile": "trainer.compile",
    "world_size": "launcher.nproc_per_node",
    "nproc_per_node": "launcher.nproc_per_node",
    "batch_size": "data.batch_size",
    "tp": "mesh.tp",
}


def resolve_backend(name: str) -> str:
    """``backend=auto``: nccl with CUDA, else gloo."""
    if name != "auto":
        return name
    return "nccl" if cuda_device_count() > 0 else "gloo"


def complete(cfg: DictConfig) -> None:
    """Decide ``backend=auto`` and then ``launcher.nproc_per_node=auto`` in ``cfg``, for this machine."""
    cfg.backend.name = resolve_backend(cfg.backend.name)
    cfg.launcher.nproc_per_node = nproc_per_node_of(cfg.launcher.nproc_per_node, cfg.backend.name)


def nproc_problems(cfg: DictConfig) -> list[Problem]:
    """``launcher.nproc_per_node`` that is not a count once ``complete`` decided ``auto``: refused before anything
    computes a world size with it."""
    nproc = cfg.launcher.nproc_per_node
    if isinstance(nproc, int) and not isinstance(nproc, bool):
        return []
    return [Problem(("launcher.nproc_per_node",), f"launcher.nproc_per_node={nproc} is neither a number of "
                    "processes nor auto.", "Set launcher.nproc_per_node=N, or auto (one per GPU under nccl, else 2).")]


# The world of a completed config (a DictConfig or the typed Config alike: they read the same keys).
def world_size(config: Any) -> int:
    """The processes of the launch: what torchrun/SLURM started when attached, else the launcher group's."""
    launch = detect_launch_env()
    if launch is not None:
        return launch.world_size
    if config.backend.name == "none":
        return config.launcher.nproc_per_node
    return config.launcher.nproc_per_node * config.launcher.nnodes


def nproc_per_node(config: Any) -> int:
    launch = detect_launch_env()
    return launch.local_world_size if launch is not None else config.launcher.nproc_per_node


def data_parallel_size(config: Any) -> int:
    """The ranks that read different batches: the world over ``mesh.tp`` (a TP group reads one batch)."""
    tp = config.mesh.tp if config.wrap.name == "fsdp2" and config.mesh.tp > 0 else 1
    return max(world_size(config) // tp, 1)


def combination_of(config: Any) -> Combination:
    """The core's view of a completed config, with this machine's facts, for its rules and for ``resolve_wrap``."""
    names = dict(CONFIG_NAMES)
    if config.launcher.nnodes > 1:
        names["world_size"] = "launcher.nproc_per_node x launcher.nnodes"
    return combination(
        backend=resolve_backend(config.backend.name),
        wrap=config.wrap.name,
        precision=config.precision.name,
        offload=config.offload.name,
        sync_bn=bool(config.model.get("sync_bn", False)),
        compile=config.trainer.compile,
        world_size=world_size(config),
        nproc_per_node=nproc_per_node(config),
        attached=detect_launch_env() is not None,
        global_batch_size=config.data.batch_size,
        data_parallel_size=data_parallel_size(config),
        names=names,
    )


def _typed(cfg: DictConfig) -> Config:
    """``cfg`` as the schema's dataclasses. A config that still holds Hydra's own node (a sweep's job, checked before
    it is submitted) is read without it: that node is Hydra's, and resolves only once a job runs."""
    if OmegaConf.get_type(cfg) is Config and "hydra" not in cfg:
        return OmegaConf.to_object(cfg)
    ours = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    return OmegaConf.to_object(OmegaConf.merge(Config, ours))


@dataclass(frozen=True)
class Settings:
    """A completed config as the rules judge it."""

    config: Config  # the schema's dataclasses, resolved; model, task, optim's targets and data.dataset are dicts
    combination: Combination  # the world, the node, the data-parallel degree, this machine's facts
    mesh: MeshShape  # as asked for (``mesh.dp_shard=-1`` not yet resolved against the world)

    @classmethod
    def of(cls, cfg: DictConfig) -> Settings:
        """``cfg``, completed (``complete``) and with a count of processes (``nproc_problems``), read once."""
        config = _typed(cfg)
        return cls(config, combination_of(config), MeshShape.of(asdict(config.mesh)))

    @property
    def attached(self) -> bool:
        """Started by torchrun, srun or mpirun: each process is one rank, and the launcher group is unused."""
        return self.combination.attached

    def get(self, key: str) -> Any:
        """The value at a dotted ``key`` (``data.batch_size``), or None where the config has no such key."""
        node: Any = self.config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        return node
