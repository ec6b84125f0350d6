"""A real ``mlflow server`` subprocess on a free loopback port, for the tests of the server path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from hydraddp.distributed.env import free_port
from tests.helpers.spawn import assert_no_orphans, child_env


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None):
        self.root, self.port = root, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.token = uuid.uuid4().hex

    def start(self, timeout_s: float = 90) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        log = (self.root / "server.log").open("a")
        # Without MLflow's job runner: hydraddp starts no server jobs, and the runner's eight huey consumers (each
        # importing mlflow) cost about a minute of CPU at every start on 2 cores.
        env = child_env(self.token, {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:  # poll for readiness; never sleep a fixed time
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(self.root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM, or (``graceful=False``) SIGKILL: a crash. Stopping gracefully, uvicorn goes on serving the
        requests of a keep-alive connection already open, so a client that keeps sending may finish before it stops."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM if graceful else signal.SIGKILL)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        assert_no_orphans(self.token)

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)
