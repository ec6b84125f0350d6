"""torch.distributed process groups (nccl, gloo, mpi) as a ``Context``."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from hydraddp.distributed.context import Context
from hydraddp.distributed.env import LaunchEnv, detect_launch_env, free_port

NATIVE_BACKENDS = ("nccl", "gloo", "mpi")

_OPS = {
    "SUM": dist.ReduceOp.SUM,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "AND": dist.ReduceOp.BAND,
    "OR": dist.ReduceOp.BOR,
}


def native_backends_available() -> tuple[str, ...]:
    if not dist.is_available():
        return ()
    checks = {"nccl": dist.is_nccl_available, "gloo": dist.is_gloo_available, "mpi": dist.is_mpi_available}
    return tuple(name for name in NATIVE_BACKENDS if checks[name]())


def agent_store(timeout: datetime.timedelta | None = None) -> dist.Store | None:
    """The store of torch's elastic agent (torchrun's, or ``Parallel``'s), shared by every worker of one launch
    and kept across restarts; None when no agent started this process."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timeout or datetime.timedelta(minutes=30))


def _attempt_store(launch: LaunchEnv, timeout: datetime.timedelta | None) -> dist.Store | None:
    """Under torch's elastic agent, the workers' store is the agent's, and it outlives a restart: without a
    prefix per attempt, restarted ranks read the dead ranks' addresses and gloo's connect fails or hangs."""
    store = agent_store(timeout)
    if store is None:
        return None
    from torch.distributed import PrefixStore

    return PrefixStore(f"hydraddp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


class NativeContext(Context):
    """A process group of torch.distributed. ``owns_group`` says whether ``finalize`` destroys it."""

    name = "native"

    def __init__(self, launch: LaunchEnv, owns_group: bool, restore_env: dict[str, str | None] | None = None):
        self._launch = launch
        self._owns_group = owns_group
        self._restore_env = restore_env or {}
        self._device = self._pick_device()

    @classmethod
    def create_from_backend(
        cls, backend: str, timeout: datetime.timedelta | None = None, **init_kwargs: Any
    ) -> NativeContext:
        """Start a process group. Rank and world come from the launcher's env, or world size 1."""
        if backend not in NATIVE_BACKENDS:
            raise ValueError(f"backend={backend!r} is not a torch.distributed backend; use one of {NATIVE_BACKENDS}")
        if dist.is_initialized():
            raise RuntimeError("A torch.distributed process group already exists; call finalize() first")
        launch = detect_launch_env() or LaunchEnv("manual", 0, 0, 1, 1, 0, 1, "127.0.0.1", None)
        wanted = {
            "MASTER_ADDR": launch.master_addr or "127.0.0.1",
            "MASTER_PORT": str(launch.master_port or free_port()),
        }
        restore = {k: os.environ.get(k) for k in wanted if os.environ.get(k) != wanted[k]}
        os.environ.update(wanted)
        if backend == "nccl":
            torch.cuda.set_device(launch.local_rank)
        if timeout is not None:
            init_kwargs["timeout"] = timeout
        if "store" not in init_kwargs and "init_method" not in init_kwargs:
            init_kwargs["store"] = _attempt_store(launch, init_kwargs.get("timeout"))
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, **init_kwargs)
        return cls(launch, owns_group=True, restore_env=restore)

    @classmethod
    def create_from_context(cls) -> NativeContext | None:
        """Attach to a process group someone else initialized (torchrun script, user code)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        launch = detect_launch_env()
        if launch is None or launch.world_size != world:
            # Started by hand without launcher variables: the best we know is one node.
            launch = LaunchEnv("manual", rank, rank, world, world, 0, 1)
        return cls(launch, owns_group=False)

    def _pick_device(self) -> torch.device:
        # ignite's rule: CUDA when present (one device per local rank), else CPU.
        if torch.cuda.is_available():
            return torch.device("cuda", self._launch.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def rank(self) -> int:
        return dist.get_rank()

    def local_rank(self) -> int:
        return self._launch.local_rank

    def world_size(self) -> int:
        return dist.get_world_size()

    def nproc_per_node(self) -> int:
        return self._launch.local_world_size

    def nnodes(self) -> int:
        return self._launch.nnodes

    def node_rank(self) -> int:
        return self._launch.node_rank

    def device(self) -> torch.device:
        return self._device

    def backend(self) -> str:
        return str(dist.get_backend())

    @property
    def launch_env(self) -> LaunchEnv:
        return self._launch

    def finalize(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        for key, value in self._restore_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def barrier(self) -> None:
        dist.barrier()

    def _do_all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if op == "AVERAGE":
            # gloo has no AVG op; SUM then divide works on every backend.
            dist.all_reduce(tensor, dist.ReduceOp.SUM)
            return tensor.div_(self.world_size()) if tensor.is_floating_point() else tensor // self.world_size()
        dist.all_reduce(tensor, _OPS[op])
        return tensor

    def _do_all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(tensor) for _ in range(self.world_size())]
        dist.all_gather(out, tensor.contiguous())
        return torch.cat(out, dim=0)

    def _do_all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size()
        dist.all_gather_object(out, obj)
        return out

    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src=src)
        return tensor

    def _do_broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
