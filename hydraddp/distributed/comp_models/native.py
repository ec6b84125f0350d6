"""torch.distributed process groups (nccl, gloo, mpi) as a computation model, with ignite's semantics."""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hydraddp.distributed import store_client
from hydraddp.distributed.comp_models.base import ComputationModel, _is_rank_list
from hydraddp.distributed.env import DEFAULT_MASTER_PORT, LaunchEnv, detect_launch_env, free_port
from hydraddp.distributed.join import join, join_timeout
from hydraddp.parallel.machine import rank_device_index

NCCL, GLOO, MPI = "nccl", "gloo", "mpi"
NATIVE_BACKENDS = (NCCL, GLOO, MPI)
has_native_dist_support = dist.is_available()
ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

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


def refuse_tcp_init_method(init_method: str | None) -> None:
    """``tcp://`` makes every rank dial one address that only rank 0 listens on after all arrive: it hangs."""
    if init_method is not None and init_method.startswith("tcp://"):
        raise ValueError(
            f"TCP initialization via init_method='{init_method}' will hang. "
            "To fix this, please configure MASTER_ADDR and MASTER_PORT in the environment and "
            "use 'env://' (or omit init_method)."
        )


def agent_store(timeout: datetime.timedelta | None = None) -> dist.Store | None:
    """The store of torch's elastic agent (torchrun's, or ``Parallel``'s), shared by every worker of one launch
    and kept across restarts; None when no agent started this process."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    return store_client.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                timeout or datetime.timedelta(minutes=30))


def _attempt_store(timeout: datetime.timedelta | None) -> dist.Store | None:
    """Under torch's elastic agent, the workers' store is the agent's, and it outlives a restart: without a
    prefix per attempt, restarted ranks read the dead ranks' addresses and gloo's connect fails or hangs."""
    store = agent_store(timeout)
    if store is None:
        return None
    from torch.distributed import PrefixStore

    return PrefixStore(f"hydraddp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _launch_for_backend(rank: int | None, world_size: int | None) -> LaunchEnv:
    """Where this process sits, from its launcher's variables, or from ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``
    (all three or none), or from the arguments; world size 1 when nothing says otherwise."""
    launch = detect_launch_env()
    if launch is not None:
        if launch.source == "slurm" and (rank is not None or world_size is not None):
            raise ValueError("Arguments rank and world_size should not be specified with SLURM")
        return launch
    defined = [key in os.environ for key in ENV_KEYS]
    if any(defined) and not all(defined):
        raise RuntimeError(f"PyTorch distributed configuration should define env variables '{list(ENV_KEYS)}'")
    rank = rank or 0
    world_size = world_size or 1
    return LaunchEnv("manual", rank, 0, world_size, world_size, 0, 1)


class _Topology(NamedTuple):
    local_rank: int
    nproc_per_node: int
    nnodes: int
    node_rank: int


NCCL_WITH_CPU_SIDE = "cuda:nccl,cpu:gloo"


def with_cpu_side(backend: str) -> str:
    """The backend string a group is made with: nccl gets a gloo side for CPU tensors (torch's own default when no
    backend is named). FSDP2 with ``offload=cpu`` clips gradients with collectives on CPU DTensors, which nccl alone
    cannot reduce."""
    return NCCL_WITH_CPU_SIDE if backend == "nccl" else backend


def backend_name(group_backend: str) -> str:
    """The backend a user asked for, from the group's: ``cuda:nccl,cpu:gloo`` is nccl (ignite's ``backend()``)."""
    return "nccl" if "nccl" in group_backend else group_backend


def _gather_on_cpu(obj: Any) -> list[Any]:
    """An object all-gather that works whatever the default group's backend (nccl has no CPU objects)."""
    if dist.get_backend() == "gloo":
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    group = dist.new_group(backend="gloo")
    try:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=group)
        return out
    finally:
        dist.destroy_process_group(group)


def _topology(rank: int, world: int, local_rank: int | None) -> _Topology:
    """Local rank and node layout. A launcher that states its per-node size (torchrun's LOCAL_WORLD_SIZE,
    SLURM, mpirun, horovodrun) is believed; otherwise, as ignite, the ranks compare notes: processes per node is
    the largest local rank + 1, and a missing local rank is counted from the hostnames (with ignite's warning)."""
    launch = detect_launch_env()
    states_node_size = launch is not None and (launch.source != "torchrun" or "LOCAL_WORLD_SIZE" in os.environ)
    if launch is not None and states_node_size and (launch.rank, launch.world_size) == (rank, world):
        return _Topology(launch.local_rank, launch.local_world_size, launch.nnodes, launch.node_rank)
    if world == 1:
        return _Topology(local_rank or 0, 1, 1, 0)
    if local_rank is None:
        warnings.warn(
            "Local rank information for native distributed setting will be initialized using "
            "a heuristic approach based on the hostnames. In some corner cases, determined "
            "local rank can be different from the real setup. To avoid this warning, "
            "please either set `os.environ['LOCAL_RANK']` "
            "or use `idist.set_local_rank(local_rank)` with correct local rank index."
        )
    notes = _gather_on_cpu((socket.gethostname(), local_rank))
    if local_rank is None:
        hosts = list(dict.fromkeys(host for host, _ in notes))
        mine = notes[rank][0]
        local_rank = sum(1 for host, _ in notes[:rank] if host == mine)
        nproc = max(sum(1 for h, _ in notes if h == host) for host in hosts)
        return _Topology(local_rank, nproc, len(hosts), hosts.index(mine))
    nproc = max(lr for _, lr in notes) + 1
    return _Topology(local_rank, nproc, max(world // nproc, 1), rank // nproc)


def _hinted_local_rank() -> int | None:
    if os.environ.get("SLURM_LOCALID", "") != "" and "SLURM_JOB_ID" in os.environ:
        return int(os.environ["SLURM_LOCALID"])
    if os.environ.get("LOCAL_RANK", "") != "":
        return int(os.environ["LOCAL_RANK"])
    return ComputationModel._ext_local_rank


class _NativeDistModel(ComputationModel):
    """A process group of torch.distributed. ``_owns_group`` says whether ``finalize`` destroys it; ``_init_method``
    is how it was started (``env://``, ``file://...``), None when it was found already running."""

    name = "native-dist"
    available_backends = native_backends_available()

    def __init__(self, topology: _Topology, owns_group: bool, init_method: str | None = None,
                 restore_env: dict[str, str | None] | None = None):
        self._topology = topology
        self._owns_group = owns_group
        self._init_method = init_method
        self._restore_env = restore_env or {}

    @staticmethod
    def create_from_backend(backend: str, init_method: str | None = None, world_size: int | None = None,
                            rank: int | None = None, timeout: datetime.timedelta | None = None,
                            **init_kwargs: Any) -> _NativeDistModel:
        """Start a process group. Rank and world come from the launcher's env, the arguments, or world size 1."""
        if backend not in _NativeDistModel.available_backends:
            raise ValueError(f"Backend should be one of '{_NativeDistModel.available_backends}', but given {backend!r}")
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("Can not create new distributed process group if default one is already initialized")
        if init_method is None and (world_size is not None or rank is not None):
            raise ValueError("Arguments rank and world_size should be None if no init_method is provided")
        if init_method is not None and (rank is None) != (world_size is None):
            raise ValueError(f"Both rank and world_size should be provided, but given {rank} and {world_size}")
        refuse_tcp_init_method(init_method)

        launch = _launch_for_backend(rank, world_size)
        port = os.environ.get("MASTER_PORT") or launch.master_port
        if not port:
            # Several ranks must meet on one port (ignite's default); a world of one needs nobody: any free port.
            port = DEFAULT_MASTER_PORT if launch.world_size > 1 else free_port()
        wanted = {
            "RANK": str(launch.rank), "LOCAL_RANK": str(launch.local_rank), "WORLD_SIZE": str(launch.world_size),
            "MASTER_ADDR": os.environ.get("MASTER_ADDR") or launch.master_addr or "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        restore = {k: os.environ.get(k) for k in wanted if os.environ.get(k) != wanted[k]}
        os.environ.update(wanted)

        init_method = init_method or "env://"
        if timeout is not None:
            init_kwargs["timeout"] = timeout
        store = _attempt_store(timeout) if init_method == "env://" and "store" not in init_kwargs else None
        if store is None and init_method == "env://" and "store" not in init_kwargs and launch.world_size > 1:
            # Attached without an agent (srun, submitit, RANK/WORLD_SIZE by hand): rank 0's store, as env:// makes it
            store = join(launch, wanted["MASTER_ADDR"], int(port), join_timeout(timeout))
            store.set_timeout(timeout or dist.default_pg_timeout)  # the group's own waits: as env:// would have them
        requested, backend = backend, with_cpu_side(backend)
        if store is not None:
            dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, store=store,
                                    **init_kwargs)
        elif init_method.startswith("env"):
            dist.init_process_group(backend, init_method=init_method, **init_kwargs)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=launch.rank,
                                    world_size=launch.world_size, **init_kwargs)
        if torch.cuda.is_available():
            torch.cuda.set_device(rank_device_index(launch.local_rank, torch.cuda.device_count()))
        # Everyone is in before anyone uses the group (and nccl learns this rank's device).
        dist.barrier(device_ids=[torch.cuda.current_device()] if requested == "nccl" else None)
        topology = _topology(dist.get_rank(), dist.get_world_size(), launch.local_rank)
        return _NativeDistModel(topology, owns_group=True, init_method=init_method, restore_env=restore)

    @staticmethod
    def create_from_context() -> _NativeDistModel | None:
        """Attach to a process group someone else initialized (torchrun script, user code)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        topology = _topology(dist.get_rank(), dist.get_world_size(), _hinted_local_rank())
        return _NativeDistModel(topology, owns_group=False)

    @staticmethod
    def spawn(fn: Callable, args: tuple, kwargs_dict: Mapping | None = None, nproc_per_node: int = 1,
              nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None,
              backend: str = "nccl", init_method: str | None = None, **kwargs: Any) -> dict[int, Any]:
        """Start ``nproc_per_node`` workers here through torch's elastic agent; see ``elastic.launch``."""
        from hydraddp.distributed import elastic

        if init_method not in (None, "env://") and (master_addr is not None or master_port is not None):
            raise ValueError("master_addr and master_port should be None if init_method is provided other then 'env://'")
        if init_method not in (None, "env://"):
            kwargs["init_method"] = init_method
        for option in ("join", "daemon"):  # torch.multiprocessing.spawn's, which ignite passes on: the agent always
            kwargs.pop(option, None)  # waits for its workers, and they are never daemons
        return elastic.launch(_NativeDistModel, backend, fn, args, dict(kwargs_dict or {}),
                              nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                              master_addr=master_addr, master_port=master_port, **kwargs)

    def get_rank(self) -> int:
        return dist.get_rank()

    def get_local_rank(self) -> int:
        return self._topology.local_rank

    def get_world_size(self) -> int:
        return dist.get_world_size()

    def get_nproc_per_node(self) -> int:
        return self._topology.nproc_per_node

    def get_nnodes(self) -> int:
        return self._topology.nnodes

    def get_node_rank(self) -> int:
        return self._topology.node_rank

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            if index < self.get_local_rank() and torch.cuda.device_count() > 1:
                warnings.warn("Current device index is less than current local rank. "
                              "Please, make sure to call torch.cuda.set_device(local_rank).")
            return torch.device(f"cuda:{index}")
        return torch.device("cpu")

    def backend(self) -> str:
        return backend_name(str(dist.get_backend()))

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

    def _setup_group(self, group: Any) -> Any:
        if _is_rank_list(group):
            group = self._do_new_group(group)
        if not (isinstance(group, dist.ProcessGroup) or group == dist.GroupMember.NON_GROUP_MEMBER):
            raise ValueError(f"Argument group should be list of int or ProcessGroup, got {type(group)}, group={group}")
        return group

    def _group_size(self, group: Any | None) -> int:
        return self.get_world_size() if group is None else group.size()

    def _do_all_reduce(self, tensor: torch.Tensor, op: str = "SUM", group: Any | None = None) -> torch.Tensor:
        group = None if group is None else self._setup_group(group)
        if op == "AVERAGE":
            # gloo has no AVG op; SUM then divide works on every backend.
            dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group)
            size = self._group_size(group)
            return tensor.div_(size) if tensor.is_floating_point() else tensor // size
        dist.all_reduce(tensor, _OPS[op], group=group)
        return tensor

    def _do_all_gather(self, tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor:
        group = None if group is None else self._setup_group(group)
        if self._rank_not_in_group(group):
            return tensor
        if tensor.dim() == 0:
            tensor = tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self._group_size(group))]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return torch.cat(out, dim=0)

    def _do_all_gather_object(self, obj: Any, group: Any | None = None) -> list[Any]:
        group = None if group is None else self._setup_group(group)
        if self._rank_not_in_group(group):
            return obj
        out: list[Any] = [None] * self._group_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src=src)
        return tensor

    def _do_broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def _do_new_group(self, ranks: list[int], **kwargs: Any) -> Any:
        return dist.new_group(ranks=ranks, **kwargs)

    def _rank_not_in_group(self, group: Any | None) -> bool:
        return dist._rank_not_in_group(group)
