"""Where the tracker runs. It sends at nice 19 (the launch's plan is made at idle priority), so the ranks come first;
that holds only inside the launcher's own session. Linux's autogroup shares the CPU between sessions as equals, so a
tracker in a session of its own would weigh as much as all the ranks together. It needs its own process group, so
that a Ctrl-C at the terminal reaches the launcher only."""

from __future__ import annotations

import os
import time

import pytest

from hydraddp.tracking.process import TrackerProcess
from hydraddp.tracking.run import KILLED

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md


def test_the_tracker_runs_at_nice_19_in_the_launchers_session_but_not_its_process_group(tmp_path):
    tracker = TrackerProcess({
        "uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "placement", "job_dir": str(tmp_path),
        "config": {"plan": {"record": False}}, "overrides": [], "tags": {}, "run_id": None, "run_name": None,
        "resuming": False, "resumed_from": None, "adopt_run": False})
    tracker.start()
    try:
        pid = tracker._proc.pid
        assert os.getsid(pid) == os.getsid(0)
        assert os.getpgid(pid) == pid != os.getpgid(0)
        deadline = time.monotonic() + 30  # it lowers its priority first thing
        while os.getpriority(os.PRIO_PROCESS, pid) != 19 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
    finally:
        tracker.finish(KILLED, "test over", timeout_s=30)
    assert tracker._proc.returncode == 0
