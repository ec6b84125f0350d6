"""The launch's MLflow run, kept in a process of its own.

Importing mlflow and creating a run costs about 1.5 CPU-seconds. In a thread of the launcher that work
competed for the GIL with the launcher's own ``import torch``. As its own process it starts before the
launcher imports torch, on the core the launcher leaves idle, and has created the run by the time the
ranks take their first step. From then on it only sends batches of events, at nice 19 (Linux): the ranks
come first, but it is never starved. (Deferring the import itself to idle time was tried: it then landed
in the ranks' first seconds of training and cost them 5-10%.)

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

from hydraddp.tracking import names
from hydraddp.tracking.events import EVENTS_FILE
from hydraddp.tracking.run import FINISHED, KILLED, LaunchRun


class TrackerProcess:
    """The launcher's handle on the tracker: ``start``, then ``finish`` with the status the launch ended with."""

    def __init__(self, settings: dict[str, Any]):
        self.settings = settings  # LaunchRun's keyword arguments, as JSON
        self.uri, self.job_dir = settings["uri"], Path(settings["job_dir"])
        self.events_path = self.job_dir / EVENTS_FILE
        self._proc: subprocess.Popen | None = None
        self._started_at = 0.0

    def start(self) -> None:
        self._started_at = time.time()
        # Its own session: a Ctrl-C reaches the launcher, which decides the status and tells the tracker.
        self._proc = subprocess.Popen([sys.executable, "-m", "hydraddp.tracking.process"], stdin=subprocess.PIPE,
                                      text=True, start_new_session=True)
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

    def finish(self, status: str, error: str | None = None, timeout_s: float = 60.0) -> bool:
        """Tell the tracker how the launch ended and wait until it has sent everything (or given up)."""
        assert self._proc is not None and self._proc.stdin is not None
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


def _yield_cpu() -> None:
    """The lowest normal priority for the calling thread (on Linux a thread has its own nice value): training
    ranks come first, but a busy machine still gives the sender a share. (``SCHED_IDLE`` starved it until
    the training ended, and the backlog then outlasted the flush timeout.)"""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, 0, 19)


PLAN_WAIT_S = 120.0  # at the end of a launch, how long its plan may still take


def _plan(run: LaunchRun, config: dict[str, Any], world_size: int) -> None:
    """The launch's plan, made here beside the workers (at nice 19, once the run exists), never in their way: written
    to ``<job dir>/plan.json`` and handed to the run, which logs it and checks it against what the ranks measure."""
    run.wait_created()
    _yield_cpu()
    try:
        from omegaconf import OmegaConf

        from hydraddp.plan.estimate import estimate

        plan = estimate(OmegaConf.create(config), world_size).to_dict()
    except Exception as exc:  # a model the simulated world cannot run: the run says so, and trains anyway
        plan = {"error": f"not planned: {type(exc).__name__}: {exc}"}
    (run.job_dir / names.PLAN_FILE).write_text(json.dumps(plan, indent=2))
    run.plan = plan


def main() -> int:
    import fcntl

    # The launcher reports an interrupt as KILLED and a preemption as such: a signal sent to the whole process group
    # (Ctrl-C, Slurm's SIGTERM) must not stop the sender before it has flushed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    settings = json.loads(sys.stdin.readline())["settings"]
    # One sender per job directory: after a restart under torchrun, the previous attempt's tracker may still
    # be flushing the same events file; this one waits for it (the kernel drops the lock when it exits).
    lock = open(Path(settings["job_dir"]) / "tracker.lock", "w")  # noqa: SIM115 - held until this process ends
    fcntl.flock(lock, fcntl.LOCK_EX)
    run_id_file = Path(settings["job_dir"], names.RUN_ID_FILE)
    if settings.pop("adopt_run", False) and run_id_file.exists():
        # A restarted group continues the run of the first attempt, known for sure only now that its tracker is done.
        settings["run_id"] = run_id_file.read_text().strip()
    plan_world = settings.pop("plan_world_size", None)
    run = LaunchRun(**{**settings, "job_dir": Path(settings["job_dir"])})
    run.start(once_created=_yield_cpu)
    planning = threading.Thread(target=_plan, args=(run, settings["config"], plan_world), name="hydraddp-plan",
                                daemon=True)
    if plan_world:
        planning.start()
    line = sys.stdin.readline()
    request = json.loads(line) if line.strip() else {
        "status": KILLED, "error": "the launching process ended without saying how the launch ended"}
    if planning.is_alive() and request["status"] == FINISHED:
        # A launch shorter than its plan gets its plan before the run is closed. One that failed or was stopped
        # does not wait: the next attempt's tracker (a restart under torchrun) waits for this one's lock.
        planning.join(PLAN_WAIT_S)
    ok = run.finish(request["status"], request.get("error"), request.get("timeout_s", 60.0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
