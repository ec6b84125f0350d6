"""Read what an outside launcher (torchrun, SLURM, mpirun, horovodrun) told this process.

Pure functions over an environment mapping, so they are testable without launching anything.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

# ignite's default: every rank started with RANK/WORLD_SIZE but no MASTER_PORT meets on this port.
DEFAULT_MASTER_PORT = 15000
# Seconds every rank of an attached launch waits for the others to form the group (``launcher.timeout``): the CLI
# sets it, the native model reads it (``join.join_timeout``). Here, so the CLI sets it without torch.
JOIN_TIMEOUT_ENV = "HYDRADDP_JOIN_TIMEOUT_S"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a job that something else started."""

    source: str  # "torchrun" | "slurm" | "mpi" | "horovod" | "manual" (no launcher variables)
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str | None = None
    master_port: int | None = None


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        if env.get(name, "") != "":
            return int(env[name])
    return default


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv | None:
    if "RANK" not in env or "WORLD_SIZE" not in env or "LOCAL_RANK" not in env:
        return None
    local_world = _int(env, "LOCAL_WORLD_SIZE", default=int(env["WORLD_SIZE"]))
    return LaunchEnv(
        source="torchrun",
        rank=int(env["RANK"]),
        local_rank=int(env["LOCAL_RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", default=int(env["RANK"]) // max(local_world, 1)),
        nnodes=max(int(env["WORLD_SIZE"]) // max(local_world, 1), 1),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_int(env, "MASTER_PORT"),
    )


def expand_first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: ``node[03-05,7],gpu1`` -> ``node03``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.fullmatch(r"(.*?)\[([^\]]+)\](.*)", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


# Step ids Slurm gives to what is not an srun step: the interactive step of salloc, the batch script and
# the "extern" step (SLURM_INTERACTIVE_STEP, SLURM_BATCH_SCRIPT, SLURM_EXTERN_CONT in slurm.h).
NOT_SRUN_STEPS = {4294967293, 4294967294, 4294967295}


def in_srun_step(env: Mapping[str, str]) -> bool:
    """True inside a job step that ``srun`` started: there, every task is one rank of the job.

    An ``salloc`` shell or an sbatch batch script also has ``SLURM_PROCID``/``SLURM_NTASKS``, but only one
    process runs there: attaching as rank 0 of N would wait forever for ranks nobody starts.
    """
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if not step.isdigit() or int(step) in NOT_SRUN_STEPS or "SLURM_PROCID" not in env:
        return False
    tasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", ""))
    return tasks.isdigit() and int(env["SLURM_PROCID"]) < int(tasks)


def slurm_allocation_outside_step(env: Mapping[str, str] | None = None) -> str | None:
    """The job id when this process runs inside a Slurm allocation but not in an srun step, else None."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env and "SLURM_PROCID" not in env:
        return None
    return None if in_srun_step(env) else env.get("SLURM_JOB_ID", "?")


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    if not in_srun_step(env):
        return None
    world = int(env.get("SLURM_STEP_NUM_TASKS", env["SLURM_NTASKS"]))
    nnodes = _int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES", default=1)
    # Ignite's convention, so jobs that mix the two tools agree on the port.
    default_port = 15000 + int(env.get("SLURM_JOB_ID", "0")[-4:] or 0)
    return LaunchEnv(
        source="slurm",
        rank=int(env["SLURM_PROCID"]),
        local_rank=_int(env, "SLURM_LOCALID", default=0),
        world_size=world,
        local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", default=max(world // nnodes, 1)),
        node_rank=_int(env, "SLURM_NODEID", default=0),
        nnodes=nnodes,
        master_addr=env.get("MASTER_ADDR") or expand_first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
        master_port=_int(env, "MASTER_PORT", default=default_port),
    )


def _from_mpi(env: Mapping[str, str], source: str, prefix: str) -> LaunchEnv | None:
    rank = _int(env, f"{prefix}RANK")
    size = _int(env, f"{prefix}SIZE")
    if rank is None or size is None:
        return None
    local_rank = _int(env, f"{prefix}LOCAL_RANK", "MPI_LOCALRANKID", default=0)
    local_size = _int(env, f"{prefix}LOCAL_SIZE", "MPI_LOCALNRANKS", default=size)
    return LaunchEnv(
        source=source,
        rank=rank,
        local_rank=local_rank,
        world_size=size,
        local_world_size=local_size,
        node_rank=_int(env, f"{prefix}CROSS_RANK", default=rank // max(local_size, 1)),
        nnodes=_int(env, f"{prefix}CROSS_SIZE", default=max(size // max(local_size, 1), 1)),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_int(env, "MASTER_PORT"),
    )


def detect_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launcher that started this process, or None when it was started by hand.

    torchrun wins over SLURM (``srun torchrun`` sets both); horovodrun's own variables win over the MPI ones
    that ``horovodrun`` over mpirun sets too.
    """
    env = os.environ if env is None else env
    return (
        _from_torchrun(env)
        or _from_slurm(env)
        or _from_mpi(env, "horovod", "HOROVOD_")
        or _from_mpi(env, "mpi", "OMPI_COMM_WORLD_")
        or _from_mpi(env, "mpi", "PMI_")
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
