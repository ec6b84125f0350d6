"""Inside a job that Hydra's submitit launcher started (``hydra/launcher=submitit_slurm``, ``submitit_local``).

Each submitit task is one rank of the job's world: it attaches to it with submitit's own
``TorchDistributedEnvironment`` (no second launcher inside the task). On preemption, after every rank checkpointed
the same step, rank 0 hands over to submitit's own handler, which pickles the job again and requeues it
(``scontrol requeue`` on Slurm, the local controller's requeue code locally); the requeued job resumes from the
job directory's preemption marker (``hydraddp.train.preemption``).
"""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn

# The hydra/launcher options that run jobs through submitit: the plugin's two and hydraddp's preset.
LAUNCHERS = ("submitit_local", "submitit_slurm", "slurm")
# Launchers whose jobs may run on other machines than the submitting one (a sqlite tracking file cannot follow).
REMOTE_LAUNCHERS = ("submitit_slurm", "slurm")


SINGLE_JOB_ENV = "HYDRADDP_SUBMITIT_SINGLE_JOB"  # set when one launch (no -m) goes through submitit


def launcher_choice(argv: list[str]) -> str | None:
    """The ``hydra/launcher=NAME`` option on the command line, if any."""
    found = [m.group(1) for a in argv if (m := re.fullmatch(r"hydra/launcher=(\S+)", a))]
    return found[-1] if found else None


def prepare_argv(argv: list[str]) -> list[str]:
    """``argv`` (``sys.argv``: the program first) for a submitit launcher, which runs as Hydra's multirun: one launch without ``-m`` becomes a sweep of one job (and is
    reported as a single launch). The job gets ``launcher.nnodes`` nodes of ``launcher.nproc_per_node`` tasks,
    unless ``hydra.launcher.nodes`` / ``tasks_per_node`` are given."""
    if launcher_choice(argv) not in LAUNCHERS:
        return argv
    # nproc_per_node=auto: one task per GPU the job asks for (config.schema.tasks_per_node). Quoted: Hydra's override
    # grammar takes a resolver's nested interpolations only inside quotes.
    tasks = "'${hydraddp.tasks_per_node:${launcher.nproc_per_node},${hydra.launcher.gpus_per_node}}'"
    values = {"tasks_per_node": tasks, "nodes": "${launcher.nnodes}"}
    extra = [f"hydra.launcher.{key}={value}" for key, value in values.items()
             if not any(a.startswith(f"hydra.launcher.{key}=") for a in argv)]
    if not {"-m", "--multirun"} & set(argv):
        os.environ[SINGLE_JOB_ENV] = "1"
        return [argv[0], "--multirun", *argv[1:], *extra]  # the flag before the overrides (argparse)
    return [*argv, *extra]


def in_task() -> bool:
    """True in a process that submitit started as a task of a job."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR")) and "SUBMITIT_FOLDER" in os.environ


def attach() -> None:
    """Export the job's world as torch's env:// variables (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE), from submitit's own job environment. CUDA_VISIBLE_DEVICES is left alone: hydraddp picks the
    device by local rank."""
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


def requeue(rank: int, exit_code: int) -> NoReturn:
    """After a preemption checkpoint: rank 0 asks submitit to requeue the job (its handler exits this process);
    the other ranks exit with ``exit_code`` (the job's requeue stops them anyway)."""
    if rank == 0:
        import signal

        from submitit import JobEnvironment

        signum = JobEnvironment._usr_sig()
        handler = signal.getsignal(signum)  # submitit's checkpoint_and_try_requeue, restored after training
        if callable(handler):
            handler(signum, None)  # requeues, then exits (raises if submitit will not requeue)
    sys.exit(exit_code)
