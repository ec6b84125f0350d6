"""``python -m hydraddp`` for the tests, forked from a process that has imported what every launch imports first.

A launch's own process spends about 3.5 CPU-seconds importing torch, torch._dynamo (imported before its workers are
forked: tests/../elastic.py) and Hydra before it does anything (py-spy: 70% of a 5-step 2-rank launch's CPU), and the
suite makes some hundreds of launches on CI's two cores. This server imports them once per pytest worker; each launch
is then a fork of it that runs ``hydraddp``'s ``__main__`` as ``python -m`` would: its own session, its own pid, the
test's environment, working directory and pipes (passed over a Unix socket), and exit status. Its workers, tracker
and plan are the real ones, started by it as they would be.

What differs from a fresh interpreter, and why it does not matter to what the tests check: the modules above are
imported already (with the environment the server started with: so only launches whose environment is the helpers'
own, ``env=None``, come here), and ``/proc/PID/environ`` shows the server's environment, so the orphan check and the
stacks of a hung launch also look for the launch's session (``session``).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_MAX_MESSAGE = 1 << 20


def serves(module: str) -> bool:
    """The commands forked here: hydraddp's own (a launch, an export, a plan) and the helpers' ``Parallel`` launch;
    not torchrun, pytest or pip, whose processes are not hydraddp's to prepare."""
    return module == "hydraddp" or module.startswith("hydraddp.") or module == "tests.helpers.launch"


def _serve(path: str) -> None:
    # What ``python -m hydraddp`` imports before its first launch, and MLflow's client, which its tracker (forked from
    # the launch: hydraddp.cli) imports first (1 to 2 CPU-seconds a tracked launch). Imported only: a process that
    # used MLflow would leave its forks its database connections, which the tracker drops (tracking/process.py).
    import hydra  # noqa: F401
    import mlflow.tracking  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (the launcher imports it before forking workers, on CPU and gloo)

    import hydraddp.cli  # noqa: F401
    import hydraddp.config.schema  # noqa: F401
    import hydraddp.launch  # noqa: F401

    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(1.0)  # to notice that its pytest worker is gone (no thread: it forks)
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:
                return
            continue
        conn.settimeout(None)
        with conn:
            message, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _run_launch(request, fds)  # never returns
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
            except OSError:  # the test went away
                pass


def _run_launch(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` in the request's session, directory and environment."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = os.getcwd()  # ``python -m``'s first entry
        sys.argv = ["-m", *request["args"]]
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (as the interpreter would: the traceback, then status 1)
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


class _Server:
    """This pytest worker's server, started at its first launch."""

    def __init__(self, env: dict[str, str]):
        self.dir = tempfile.mkdtemp(prefix="hydraddp-zygote-")
        self.path = str(Path(self.dir, "socket"))
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.zygote", self.path], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the zygote did not start (exit {self.proc.wait()})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_server: _Server | None = None


@atexit.register
def _stop_server() -> None:
    if _server is not None:
        _server.stop()


class Launch:
    """What ``run_process`` uses of ``subprocess.Popen``, for a launch forked by the server."""

    def __init__(self, module: str, args: list[str], cwd: Path, env: dict[str, str], token_var: str):
        global _server
        # pytest names the running test in PYTEST_CURRENT_TEST: a server per test would start anew at every test
        base_env = {key: value for key, value in env.items() if key not in (token_var, "PYTEST_CURRENT_TEST")}
        if _server is None or not _server.alive() or _server.env != base_env:
            if _server is not None:
                _server.stop()
            _server = _Server(base_env)
        self.module = module
        self.returncode: int | None = None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(_server.path)
        request = {"module": module, "args": args, "cwd": str(cwd), "env": env}
        socket.send_fds(self.conn, [json.dumps(request).encode()], [devnull, out_w, err_w])
        for fd in (devnull, out_w, err_w):
            os.close(fd)
        self.replies = self.conn.makefile("r")
        self.pid = json.loads(self.replies.readline())["pid"]
        self.session = self.pid
        self.outputs = {"out": [], "err": []}
        self.readers = [threading.Thread(target=self._read, args=(fd, self.outputs[name]), daemon=True)
                        for fd, name in ((out_r, "out"), (err_r, "err"))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(fd: int, chunks: list[bytes]) -> None:
        with os.fdopen(fd, "rb") as pipe:
            while data := pipe.read1(65536):
                chunks.append(data)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self.readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired([self.module], timeout)
        if self.returncode is None:
            self.conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.01))
            try:
                self.returncode = json.loads(self.replies.readline())["returncode"]
            except (TimeoutError, socket.timeout):
                raise subprocess.TimeoutExpired([self.module], timeout) from None
            self.conn.close()
        text = lambda name: b"".join(self.outputs[name]).decode(errors="replace")  # noqa: E731
        return text("out"), text("err")


if __name__ == "__main__":
    _serve(sys.argv[1])
