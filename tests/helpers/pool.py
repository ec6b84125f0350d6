"""A reused process group: real workers started once, running many check bodies (torch's
``MultiProcContinuousTest`` pattern, where a spawn per check would dominate the suite's time).

The pool is one ``Parallel`` launch (``python -m tests.helpers.pool``) whose workers connect back to the test
process and run ``fn(local_rank, *args)`` for each body they are sent, in the same process group. A body that
raises is reported with its rank and traceback and the pool goes on; a body that hangs (a collective one rank
never joined) kills the pool, which the next body starts again. Keep real launches for what only a launch shows:
spawning, failures of a worker, signals, environments.
"""

from __future__ import annotations

import importlib
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any

from tests.helpers.spawn import REPO, assert_no_orphans, child_env

AUTHKEY_VAR = "HYDRADDP_POOL_AUTHKEY"
# Horovod's background loop negotiates every cycle (1 ms by default), waiting ranks too: about a third of a core per
# rank while a pool sits between bodies. Its bodies are a few collectives each, for which 5 ms cycles cost nothing.
IDLE_HOROVOD = {"HOROVOD_CYCLE_TIME": "5"}
_STOP = b""


class ProcessGroupPool:
    """``nproc`` workers of ``backend`` (``None``: one process, no group), kept for many ``run`` calls."""

    def __init__(self, backend: str | None = "gloo", nproc: int = 2, log_dir: Path | None = None):
        self.backend, self.nproc = backend, nproc if backend else 1
        log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        self.log_path = log_dir / f"pool-{backend}-{nproc}-{uuid.uuid4().hex[:8]}.log"
        self.proc: subprocess.Popen | None = None
        self.connections: dict[int, Connection] = {}
        self.token = ""
        self.bodies = 0

    def start(self, timeout_s: float = 120) -> None:
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = listener.address
        self.token = uuid.uuid4().hex
        env = child_env(self.token, {AUTHKEY_VAR: authkey.hex(), **(IDLE_HOROVOD if self.backend == "horovod" else {})})
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.pool", host, str(port),
                                          str(self.backend or "none"), str(self.nproc)],
                                         cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
        accepted: list[Connection] = []

        def accept() -> None:  # Listener.accept has no timeout: a thread, joined with one
            for _ in range(self.nproc):
                accepted.append(listener.accept())

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        acceptor.join(timeout_s)
        listener.close()
        if len(accepted) < self.nproc:
            self.kill()
            raise AssertionError(f"the pool's {self.nproc} workers did not all connect in {timeout_s}s:\n"
                                 f"{self.log_tail()}")
        self.connections = {pickle.loads(conn.recv_bytes()): conn for conn in accepted}

    def run(self, target: str, *args: Any, timeout: float = 180) -> dict[int, Any]:
        """Run ``target`` ("module:function") as ``fn(local_rank, *args)`` on every worker: ``{rank: value}``."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.bodies += 1
        payload = pickle.dumps((target, args))
        for conn in self.connections.values():
            conn.send_bytes(payload)
        results, errors = {}, {}
        rank_of = {conn: rank for rank, conn in self.connections.items()}
        deadline = time.monotonic() + timeout
        pending = list(self.connections.values())
        while pending:
            # Once a rank has failed, the others get a short grace: they may be waiting in a collective for it.
            left = deadline - time.monotonic() if not errors else min(10.0, deadline - time.monotonic())
            ready = wait(pending, timeout=max(left, 0))
            if not ready:
                self.kill()
                hung = sorted(rank_of[c] for c in pending)
                raise AssertionError(f"{target} did not finish on ranks {hung}" + self._explain(errors)
                                     + f"\nworker log:\n{self.log_tail()}")
            for conn in ready:
                pending.remove(conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, value = "error", "the worker exited"
                (results if status == "ok" else errors)[rank_of[conn]] = value
        if errors:
            raise AssertionError(f"{target} failed" + self._explain(errors))
        return results

    @staticmethod
    def _explain(errors: dict[int, str]) -> str:
        return "".join(f"\n--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items()))

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.connections = {}
        if self.token:
            assert_no_orphans(self.token)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for conn in self.connections.values():
                try:
                    conn.send_bytes(_STOP)
                except OSError:
                    pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class Pools:
    """One pool per (backend, nproc), started on first use and closed with the session."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.pools = log_dir, {}

    def __call__(self, backend: str | None = "gloo", nproc: int = 2) -> ProcessGroupPool:
        key = (backend, nproc if backend else 1)
        if key not in self.pools:
            self.pools[key] = ProcessGroupPool(backend, nproc, self.log_dir)
        return self.pools[key]

    def run(self, target: str, *args: Any, backend: str | None = "gloo", nproc: int = 2, timeout: float = 180):
        return self(backend, nproc).run(target, *args, timeout=timeout)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


# --- the worker side ------------------------------------------------------------------------------------------------

def _reset_between_bodies() -> None:
    """What one body may leave behind that the next must not see."""
    import torch

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    torch.set_default_dtype(torch.float32)


def serve(local_rank: int, host: str, port: int) -> None:
    import hydraddp.distributed as idist

    conn = Client((host, port), authkey=bytes.fromhex(os.environ[AUTHKEY_VAR]))
    conn.send_bytes(pickle.dumps(idist.get_rank()))
    while (message := conn.recv_bytes()) != _STOP:
        target, args = pickle.loads(message)
        try:
            module, name = target.split(":")
            outcome = ("ok", getattr(importlib.import_module(module), name)(local_rank, *args))
        except BaseException:  # noqa: BLE001 - reported to the test with its traceback; the pool goes on
            outcome = ("error", traceback.format_exc())
        finally:
            _reset_between_bodies()
        conn.send_bytes(pickle.dumps(outcome))


def main(host: str, port: str, backend: str, nproc: str) -> None:
    import hydraddp.distributed as idist

    # Forked as the CLI forks its workers where that is safe (gloo, no GPU): they start with torch imported.
    parallel = idist.Parallel() if backend == "none" else idist.Parallel(
        backend=backend, nproc_per_node=int(nproc), start_method=idist.worker_start_method(backend))
    parallel.run(serve, host, int(port))


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(lambda: main(*sys.argv[1:5]))  # as hydraddp's own commands end
