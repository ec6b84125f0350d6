"""A rank that refuses or never comes ends every rank of the job, within ``launcher.timeout``, each exiting non-zero.

Measured on a Slurm cluster: after a requeue, rank 0 refused its checkpoint in preflight and exited 2, and ranks 1-3
waited for it until cancelled. That refusal under a real srun is scripts/slurm_checks/refusal.py, on the Slurm cluster
in containers. Here ``srun`` is simulated by hand only for what that cluster cannot show (two ``python -m hydraddp``
processes with the variables srun gives each task, one of them never started), and torchrun is the real one. Rank
0's refusal is one that only the leading rank can find: ``checkpoint.resume`` pointing at a corrupt checkpoint (only
the leader knows the agreed job directory, so only it checks the resume). Only a launch shows this: the ranks are
separate processes that meet on rank 0's store.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hydraddp.distributed.env import free_port
from tests.helpers.spawn import NO_PLAN, UNTRACKED, assert_no_orphans, child_env, run_cli, run_process

pytestmark = pytest.mark.slow  # launches for real

BASE = [UNTRACKED, NO_PLAN, "trainer.max_steps=2", "launcher.nproc_per_node=auto"]


def corrupt_checkpoint(root: Path) -> Path:
    """A checkpoint directory whose metadata is not JSON (a write cut short, a file system that lost it)."""
    path = root / "checkpoints" / "step_000010"
    path.mkdir(parents=True)
    (path / "meta.json").write_text("{not json")
    return path


def srun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What srun gives task ``rank`` of a one-node step (``detect_launch_env`` reads these)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": str(world), "SLURM_STEP_NUM_TASKS": str(world), "SLURM_NTASKS_PER_NODE": str(world),
            "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def srun_tasks(ranks: list[int], world: int, overrides: list[str], cwd: Path,
               limit: float) -> dict[int, tuple[int, float, str]]:
    """Start ``python -m hydraddp`` as tasks ``ranks`` of a ``world``-task srun step, at once; wait for all. Returns
    ``{rank: (exit code, seconds from the start to its exit, stderr)}``; kills them all past ``limit``."""
    token, port = uuid.uuid4().hex, free_port()
    cwd.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    procs = {rank: subprocess.Popen([sys.executable, "-m", "hydraddp", *overrides], cwd=cwd,
                                    env=child_env(token, srun_env(rank, world, port)), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank in ranks}
    ended: dict[int, tuple[int, float, str]] = {}
    try:
        for rank, proc in procs.items():
            _, err = proc.communicate(timeout=max(limit - (time.monotonic() - started), 1))
            ended[rank] = (proc.returncode, time.monotonic() - started, err)
    except subprocess.TimeoutExpired:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"ranks still running after {limit:.0f} s: {sorted(set(procs) - set(ended))}") from None
    finally:
        assert_no_orphans(token)
    return ended


def test_a_non_positive_launcher_timeout_is_refused_before_anything_starts(tmp_path):
    done = run_cli(*BASE, "launcher.timeout=0", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "launcher.timeout=0" in done.stderr and "Set launcher.timeout to a positive number" in done.stderr
    assert "Traceback" not in done.stderr


def test_under_srun_a_rank_that_never_comes_ends_the_others_at_launcher_timeout(tmp_path):
    # Rank 0 never starts (its node failed before Python did): nobody can tell rank 1, the timeout ends it.
    timeout = 20
    # The peer: the same start-up (Hydra, preflight, torch, rank 0's store), ended by rank 0's refusal, not the timeout.
    checkpoint = corrupt_checkpoint(tmp_path / "peer")
    peer = srun_tasks([0, 1], 2, [*BASE, f"checkpoint.resume={checkpoint}", f"hydra.run.dir={tmp_path / 'peer'}"],
                      tmp_path / "peer", limit=300)
    assert [code for code, _, _ in peer.values()] == [2, 1], peer[1][2][-3000:]
    peer_s = peer[1][1]
    ended = srun_tasks([1], 2, [*BASE, f"launcher.timeout={timeout}"], tmp_path / "alone", limit=timeout + 300)
    code, wall, err = ended[1]
    assert code == 1, err[-3000:]
    told = f"rank 1 stopped before training: rank 0 did not join within launcher.timeout={timeout} s: see rank 0's log"
    assert told in err
    assert "Traceback" not in err
    assert timeout <= wall < timeout + 2 * peer_s + timeout / 4, (wall, peer_s)
    print(f"srun, rank 0 absent: rank 1 ended after {wall:.1f} s (launcher.timeout={timeout}; told of a refusal "
          f"instead: {peer_s:.1f} s)")


def test_under_torchrun_a_rank_0_that_refuses_stops_every_worker_and_torchrun_fails(tmp_path):
    # torchrun's agent, not hydraddp, ends the others: verified, not assumed.
    timeout = 300
    checkpoint = corrupt_checkpoint(tmp_path / "run")
    started = time.monotonic()
    done = run_process([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", "-m", "hydraddp", *BASE, f"checkpoint.resume={checkpoint}",
                        f"launcher.timeout={timeout}", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, timeout=timeout)
    wall = time.monotonic() - started
    assert done.returncode != 0, done.stderr[-3000:]
    assert "invalid configuration" in done.stderr and "unreadable meta.json" in done.stderr
    assert "exitcode  : 2" in done.stderr  # the agent names rank 0's exit, and stopped rank 1 (no orphan: run_process)
    assert wall < timeout / 2, wall
    print(f"torchrun refusal: torchrun ended after {wall:.1f} s (launcher.timeout={timeout})")
