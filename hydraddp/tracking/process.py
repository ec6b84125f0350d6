"""The launch's MLflow run, kept in a process of its own.

Importing mlflow and creating a run costs about 1.5 CPU-seconds. In a thread of the launcher that work would
compete for the GIL with the launcher and its workers. Forked from the launcher once it has imported torch
(``hydraddp.forked``; a fresh interpreter where it cannot fork), it runs at nice 19 in the launcher's session, so
the ranks come first (a process in a session of its own would be weighed against all the ranks together, by Linux's
autogroup) but it is never starved. The launch's plan is made by the launcher,
at idle priority (``hydraddp.plan.record.Recording``); the run logs ``plan.json`` once it is written.

The launcher sends two JSON lines on the tracker's stdin: the run's settings at start, the final status
at the end. The tracker writes the run id to ``<job dir>/mlflow_run_id`` and prints, like the launcher
would, what to do when the server never came back. If the launcher dies, stdin closes and the run is
marked KILLED.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hydraddp.forked import ForkedChild, leave_the_launcher
from hydraddp.tracking import names
from hydraddp.tracking.events import EVENTS_FILE
from hydraddp.tracking.run import FINISHED, KILLED, LaunchRun
from hydraddp.tracking.source import source_tags
from hydraddp.tracking.system_metrics import NodeSystemMetrics


PLAN_WAIT_S = 120.0  # at the end of a launch, how long its plan may still take


class TrackerProcess:
    """The launcher's handle on the tracker: ``start``, then ``finish`` with the status the launch ended with."""

    def __init__(self, settings: dict[str, Any]):
        self.settings = settings  # LaunchRun's keyword arguments, as JSON
        self.uri, self.job_dir = settings["uri"], Path(settings["job_dir"])
        self.events_path = self.job_dir / EVENTS_FILE
        self._proc: subprocess.Popen | ForkedChild | None = None
        self._started_at = 0.0
        self._plan: Any = None  # the launch's plan in the making (plan_with)

    def start(self, fork: bool = False) -> None:
        """``fork``: a fork of this process (``hydraddp.forked``), which starts with what it imported; else a fresh
        ``python -m hydraddp.tracking.process``."""
        self._started_at = time.time()
        if fork and threading.active_count() == 1:  # a thread's locks would stay held in the child
            self._proc = _forked_tracker()
        else:
            # Its own process group: a Ctrl-C reaches the launcher, which decides the status and tells the tracker.
            # Not its own session: Linux's autogroup would then share the CPU between the tracker and all the ranks
            # as equals, and its nice 19 (and the plan's idle priority) would count only within its own group.
            group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
            self._proc = subprocess.Popen([sys.executable, "-m", "hydraddp.tracking.process"],
                                          stdin=subprocess.PIPE, text=True, **group)
        self._send({"settings": self.settings})

    def _send(self, message: dict[str, Any]) -> bool:
        """False when the tracker is gone (it died): ``finish`` then says so."""
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
            return True
        except BrokenPipeError:
            return False

    @property
    def run_id(self) -> str | None:
        path = self.job_dir / names.RUN_ID_FILE
        if path.exists() and path.stat().st_mtime >= self._started_at - 1:  # this launch's, not a stale file
            return path.read_text().strip()
        return self.settings.get("run_id")

    def plan_with(self, recording: Any) -> None:
        """The launch's plan in the making (``hydraddp.plan.record.Recording``), which the run logs once it is
        written: a launch that ends well waits for it (a launch shorter than its plan gets it too); any other end
        stops it."""
        self._plan = recording

    def finish(self, status: str, error: str | None = None, timeout_s: float = 60.0) -> bool:
        """Tell the tracker how the launch ended and wait until it has sent everything (or given up)."""
        assert self._proc is not None and self._proc.stdin is not None
        if self._plan is not None:
            if status == FINISHED:
                self._plan.wait(PLAN_WAIT_S)
            self._plan.cancel()
        told = self._send({"status": status, "error": error, "timeout_s": timeout_s})
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            told = False
        try:
            # The tracker waits timeout_s for the server, then writes the events' fate; allow for both.
            code = self._proc.wait(timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
            told = False
        if code == 0:
            return True
        if not told:  # a tracker that gave up on the server has printed what to do; a dead one has not
            print(f"hydraddp: the MLflow tracker ended early (exit {code}); the events stay in {self.events_path}. "
                  f"Send them with: python -m hydraddp.tracking.sync {self.job_dir} --uri {self.uri} "
                  f"--status {status}", flush=True)
        return False


def _forked_tracker() -> ForkedChild:
    """The tracker as a fork of this process, in a process group of its own, reading its stdin from a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(read, 0)
        leave_the_launcher()
        _leave_mlflows_connections()
        os.setpgid(0, 0)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the process's own stdin
        from hydraddp.exit_codes import exit_without_teardown

        exit_without_teardown(main)
    os.close(read)
    return ForkedChild(pid, open(write, "w", encoding="utf-8"))  # noqa: SIM115 - closed by finish


def _leave_mlflows_connections() -> None:
    """In a tracker forked from a process that used MLflow (a sweep's, which made the parent run): MLflow keeps one
    SQLAlchemy engine per database for the whole process, and the fork would go on with the parent's pooled
    connections (forked trackers once shared them and never created their runs). SQLAlchemy's own recipe for a fork:
    each engine drops its pool without closing the parent's connections, and opens its own."""
    if "mlflow.store.tracking.sqlalchemy_store" not in sys.modules:
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    for engine in list(SqlAlchemyStore._engine_map.values()):
        engine.dispose(close=False)


def launch_run_of(settings: dict[str, Any]) -> LaunchRun:
    """The ``LaunchRun`` of the launcher's settings (``TrackerProcess.settings``), completed
    as only the tracker can: the run a restarted group adopts, and the source's tags."""
    settings = dict(settings)
    run_id_file = Path(settings["job_dir"], names.RUN_ID_FILE)
    if settings.pop("adopt_run", False) and run_id_file.exists():
        # A restarted group continues the run of the first attempt, known for sure only now that its tracker is done.
        settings["run_id"] = run_id_file.read_text().strip()
    # Found here, not in the launcher: git takes tens of milliseconds that the ranks' start-up need not wait for.
    settings["tags"] = {**source_tags(Path.cwd(), settings.pop("entry_point", "python -m hydraddp")), **settings["tags"]}
    return LaunchRun(**{**settings, "job_dir": Path(settings["job_dir"])})


def main() -> int:
    import fcntl

    # The launcher reports an interrupt as KILLED and a preemption as such: a signal sent to the whole process group
    # or job step (Ctrl-C; Slurm's SIGTERM, and the SIGUSR1/SIGUSR2 it sends every process of a job before its time
    # limit, which once killed this sender and left a timed-out job's run RUNNING) must not stop it before it has
    # flushed. It ends when the launcher says so, or when the launcher's end closes its stdin.
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(stop, signal.SIG_IGN)
    # The ranks come first, from the start: on a busy machine the run is created, and the events sent, in the time the
    # ranks leave (a 2-core machine has some while they wait for each other), and a short launch waits for it at the end.
    # Measured side by side (5 rounds, 2 ranks on 2 cores): startup and steady samples/s within 3% of tracking off;
    # creating the run at normal priority cost ~0.5 s of startup.
    os.nice(19)
    settings = json.loads(sys.stdin.readline())["settings"]
    # One sender per job directory: after a restart under torchrun, the previous attempt's tracker may still
    # be flushing the same events file; this one waits for it (the kernel drops the lock when it exits).
    lock = open(Path(settings["job_dir"]) / "tracker.lock", "w")  # noqa: SIM115 - held until this process ends
    fcntl.flock(lock, fcntl.LOCK_EX)
    run = launch_run_of(settings)
    continued = run.run_id is not None  # before start(), which creates the run when there is none
    run.start()
    system = settings["config"].get("tracking", {}).get("system_metrics", {"enabled": False})
    node_metrics = NodeSystemMetrics(run.uri, 0, system["interval_s"], continued=continued) \
        if system["enabled"] else None
    if node_metrics is not None:
        threading.Thread(target=lambda: (run.wait_created(), node_metrics.start(run.run_id)),
                         name="hydraddp-system-metrics", daemon=True).start()
        run.before_close.append(node_metrics.finish)  # its last sample, while the run is still open
    line = sys.stdin.readline()
    request = json.loads(line) if line.strip() else {
        "status": KILLED, "error": "the launching process ended without saying how the launch ended"}
    ok = run.finish(request["status"], request.get("error"), request.get("timeout_s", 60.0))
    return 0 if ok else 1


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
