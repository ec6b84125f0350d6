"""A helper process forked from the launcher (its MLflow tracker, once torch is imported; its plan, where the launch
forks its workers): it starts with what the launcher imported instead of importing it again in a fresh interpreter
(torch alone is about 2 CPU-seconds), and first drops what is the launcher's, not its own (``leave_the_launcher``).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import time
from typing import TextIO

# The signals the launcher handles itself (Ctrl-C; Slurm's SIGTERM and its time-limit signals).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def leave_the_launcher() -> None:
    """In the forked child, before its own work: the launcher's signal handlers (its own are set after), exit
    handlers (its claim's release, its temporary directories), log handlers (its job's log file) and open files are
    not this process's. Standard input, output and error stay. A process that ends when its stdin closes sees it
    close when the launcher dies, not when another of the launcher's children does."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_DFL)
    atexit._clear()
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger):
            logger.handlers.clear()
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))


class ForkedChild:
    """What a launcher uses of ``subprocess.Popen`` (``pid``, ``stdin``, ``wait``, ``poll``, ``kill``), for a child
    it forked."""

    def __init__(self, pid: int, stdin: TextIO | None = None):
        self.pid, self.stdin = pid, stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            if self.returncode is None:
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
