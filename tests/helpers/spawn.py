"""The one multi-process helper: real workers on free ports, with a timeout and a no-orphan check.

Each launch runs in its own subprocess (its own session), tagged with a unique environment token, so a
hang is killed as a group and any process that outlives it is found by that token in /proc.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.helpers import zygote

REPO = Path(__file__).resolve().parents[2]
TOKEN_VAR = "HYDRADDP_TEST_TOKEN"
# ``python -m hydraddp`` with the helpers' own environment is forked from a process that imported torch and Hydra
# (tests/helpers/zygote.py); HYDRADDP_TEST_ZYGOTE=0 starts each as a fresh interpreter instead.
ZYGOTE = os.environ.get("HYDRADDP_TEST_ZYGOTE", "1") != "0"
# A tracked launch's own plan (plan.record) is made by a process at idle priority that a finished launch waits for:
# about 6 s of every tracked launch on 2 cores, and far more while other tests load them. Tests of something else
# leave it out; tests/plan, tests/tracking/test_mlflow.py, test_compare.py and test_secrets.py keep it.
NO_PLAN = "plan.record=false"
# A tracked launch's MLflow run is kept by a tracker process (mlflow, its SQL store and torch imported: about 12
# CPU-seconds, after the ranks on 2 cores). Launches that test the CLI, launchers or training itself leave it out;
# the tests of tracking, resumes into the same run and preemption keep it, and so do test_cli's sweep of every wrap.
UNTRACKED = "tracking.enabled=false"
# A tracked launch logs the trained model at the end (torch and MLflow's pytorch flavor in the tracker: about 3
# CPU-seconds and 2 s of a 12-step launch here). Tracked launches that check something else leave it out; the
# model's own tests (test_logged_model.py, test_library_models.py), test_mlflow's contract launches, test_cli's sweep
# and the pairwise matrix's rows keep it.
NO_MODEL = "tracking.model.enabled=false"


def rendezvous_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999), for a rendezvous that several "nodes" on loopback
    join. A port from bind(0) is in that range, so a node that connects before node 0 listens could be given that
    very port as its own source port and connect to itself (TCP's simultaneous open): its rendezvous never returns.
    That hung a two-node test under load."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def processes_with_token(token: str, session: int | None = None) -> list[int]:
    """PIDs whose environment holds ``HYDRADDP_TEST_TOKEN=token``, or (``session``) in that session; zombies excluded.
    (A launch forked by tests/helpers/zygote.py shows the zygote's environment in /proc: its session finds it.)"""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
            if fields[0] == "Z":
                continue
            if (session is not None and int(fields[3]) == session) \
                    or needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def stacks(token: str, limit: int = 12000, session: int | None = None) -> str:
    """The Python stack of every thread of every process still holding ``token`` (py-spy, from the test extra), for the
    message of a launch that hung: which rank waits in what, from a CI log alone. Taken before the kill."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    dumps = []
    for pid in sorted(processes_with_token(token, session)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
            dumped = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            text = dumped.stdout or dumped.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"(no stack: {type(exc).__name__}: {exc})"
        dumps.append(f"--- pid {pid}: {cmdline}\n{text.strip()}")
    return "\n".join(dumps)[:limit]


def _token_of(proc: subprocess.Popen) -> str:
    """The token a helper of this module gave ``proc`` (its environment's), "" for none."""
    with contextlib.suppress(OSError):
        for entry in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(f"{TOKEN_VAR}=".encode()):
                return entry.split(b"=", 1)[1].decode()
    return ""


def assert_no_orphans(token: str, grace_s: float = 5.0, session: int | None = None) -> None:
    deadline = time.monotonic() + grace_s
    while (left := processes_with_token(token, session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes outlived the launch: {left}")


def child_env(token: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, TOKEN_VAR: token, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.update(extra or {})
    return env


@dataclass
class Launched:
    """What a subprocess left behind."""

    returncode: int
    stdout: str
    stderr: str
    token: str


def run_process(cmd: list[str], timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None,
                check_orphans: bool = True) -> Launched:
    """Run ``cmd`` in its own session with a token; kill the whole group on timeout; check for orphans."""
    token = uuid.uuid4().hex
    session = None
    if env is None and cmd[:2] == [sys.executable, "-m"] and zygote.serves(cmd[2]) and ZYGOTE:
        proc = zygote.Launch(cmd[2], cmd[3:], cwd or REPO, child_env(token), TOKEN_VAR)
        session = proc.session
    else:
        proc = subprocess.Popen(cmd, cwd=cwd or REPO, env=child_env(token, env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = stacks(token, session=session)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout}s\nstacks:\n{hung}\nstdout:\n{out[-3000:]}\n"
                             f"stderr:\n{err[-5000:]}") from None
    finally:
        if check_orphans:
            assert_no_orphans(token, session=session)
    return Launched(proc.returncode, out, err, token)


def run_parallel(target: str, *args: Any, nproc: int = 2, backend: str = "gloo", timeout: float = 120,
                 env: dict[str, str] | None = None, tmp_path: Path, expect_failure: bool = False, **parallel_kwargs: Any):
    """Run ``target`` ("module:function") as ``fn(local_rank, *args)`` on ``nproc`` real workers via ``Parallel``.

    Returns ``{rank: return value}``; with ``expect_failure`` returns the ``WorkerFailedError`` fields instead, and
    the launch's ``stderr`` (where the workers write).
    """
    payload, result = tmp_path / f"payload-{uuid.uuid4().hex}.pt", tmp_path / f"result-{uuid.uuid4().hex}.pt"
    torch.save({"target": target, "args": args, "nproc": nproc, "backend": backend, "kwargs": parallel_kwargs}, payload)
    launched = run_process([sys.executable, "-m", "tests.helpers.launch", str(payload), str(result)], timeout, env)
    if launched.returncode != 0 or not result.exists():
        raise AssertionError(f"launch exited {launched.returncode}\nstdout:\n{launched.stdout[-3000:]}\nstderr:\n{launched.stderr[-6000:]}")
    outcome = torch.load(result, weights_only=False)
    if expect_failure:
        assert "failure" in outcome, f"expected a worker failure, got results {outcome}"
        return {**outcome["failure"], "stderr": launched.stderr}
    if "failure" in outcome:
        raise AssertionError(f"worker failed: {outcome['failure']}\nstderr:\n{launched.stderr[-6000:]}")
    return outcome["results"]


def run_together(commands: list[tuple], timeout: float = 180) -> list[Launched]:
    """Run several processes at once (e.g. one per node), each ``(cmd, cwd)`` or ``(cmd, cwd, env)``; wait for all;
    check for orphans."""
    token = uuid.uuid4().hex
    procs = [subprocess.Popen(cmd, cwd=cwd, env=child_env(token, extra[0] if extra else None), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for cmd, cwd, *extra in commands]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{[cmd for cmd, *_ in commands]} timed out after {timeout}s\nstacks:\n{stacks(token)}") \
            from None
    finally:
        for proc in procs:
            proc.kill()
        assert_no_orphans(token)
    return [Launched(proc.returncode, out, err, token) for proc, (out, err) in zip(procs, outputs)]


def wait_while_running(proc: subprocess.Popen, ready: Callable[[], Any], what: str, timeout: float = 120) -> Any:
    """Poll ``ready()`` until it gives something true, and return that. The launch ``proc`` must still be running
    then: one that ended first, or hung past ``timeout`` (a guard, not a measure of speed), fails with its output."""
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if proc.poll() is not None:
            pytest.fail(f"the launch ended (exit {proc.returncode}) before {what}: {proc.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout:.0f} s: the launch hung\nstacks:\n{stacks(_token_of(proc))}")
        time.sleep(0.05)
    return found


def interrupt_when(cmd: list[str], ready, cwd: Path, timeout: float = 90, env: dict[str, str] | None = None,
                   send=None) -> Launched:
    """Start ``cmd`` in its own session, wait until ``ready()`` while it runs, press Ctrl-C (SIGINT; or call
    ``send(proc)`` to signal it otherwise), and collect what it printed; then check that no process of it is left."""
    token = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(token, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_while_running(proc, ready, "it was ready to be signalled", timeout)
        if send is None:
            proc.send_signal(signal.SIGINT)
        else:
            send(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launch did not end {timeout:.0f} s after the signal\nstacks:\n{stacks(token)}")
    finally:
        proc.kill()
    assert_no_orphans(token)
    return Launched(proc.returncode, out, err, token)


def wait_for_published_checkpoint(proc: subprocess.Popen, root: Path, step: int, timeout: float = 120) -> None:
    """Wait until the checkpoint of ``step`` under ``root/outputs``' job is published: written in the background
    (``checkpoint.async_save``), it may be whole only some steps later on a loaded machine, and a worker killed
    before that restarts from an earlier one, or from scratch."""
    wait_while_running(proc, lambda: list(root.glob(f"outputs/*/*/checkpoints/step_{step:08d}")),
                       f"the checkpoint of step {step}", timeout)


def sigkill_rank_when_logged(proc: subprocess.Popen, root: Path, pattern: str, rank: int = 1,
                             timeout: float = 120) -> None:
    """Wait until ``rank``'s log under ``root/outputs`` matches ``pattern`` while ``proc`` runs, then SIGKILL
    that rank (its pid is in its log): a worker dying mid-run."""
    def matching_log() -> str | None:
        logs = list(root.glob(f"outputs/*/*/logs/rank{rank}.log"))
        text = logs[0].read_text() if logs else ""
        return text if re.search(pattern, text) else None

    text = wait_while_running(proc, matching_log, f"rank {rank}'s log matching {pattern!r}", timeout)
    os.kill(int(re.search(rf"rank {rank} pid (\d+)", text)[1]), signal.SIGKILL)


def run_cli(*args: str, cwd: Path, timeout: float = 180, env: dict[str, str] | None = None) -> Launched:
    """``python -m hydraddp *args`` in ``cwd`` (where its outputs/ go), with the no-orphan check."""
    cwd.mkdir(parents=True, exist_ok=True)
    return run_process([sys.executable, "-m", "hydraddp", *args], timeout=timeout, env=env, cwd=cwd)


def job_dirs(root: Path) -> list[Path]:
    """The job directories a single run left under ``root/outputs`` (one per launch)."""
    return sorted(p.parent for p in root.glob("outputs/*/*/.hydra"))
