"""Where the tracker runs. It sends at nice 19 (the launch's plan is made at idle priority), so the ranks come first;
that holds only inside the launcher's own session. Linux's autogroup shares the CPU between sessions as equals, so a
tracker in a session of its own would weigh as much as all the ranks together. It needs its own process group, so
that a Ctrl-C at the terminal reaches the launcher only."""

from __future__ import annotations

import os
import sys
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


# The CLI run from Python code with an exit handler of its own, recording the forked tracker's priority and place.
CALLER = """
import atexit, os, runpy, sys, time
from pathlib import Path
import hydraddp.tracking.process as process
out = Path(sys.argv[1])
atexit.register(lambda: (out / "exit_handlers_run_by").open("a").write(f"{os.getpid()}\\n"))
fork = process._forked_tracker
def recorded():
    child = fork()
    deadline = time.monotonic() + 30  # it lowers its priority after it took its own process group
    while os.getpriority(os.PRIO_PROCESS, child.pid) != 19 and time.monotonic() < deadline:
        time.sleep(0.01)
    (out / "tracker").write_text(f"nice {os.getpriority(os.PRIO_PROCESS, child.pid)} "
                                 f"own group {os.getpgid(child.pid) == child.pid != os.getpgid(0)} "
                                 f"launcher's session {os.getsid(child.pid) == os.getsid(0)}")
    return child
process._forked_tracker = recorded
print(f"caller pid {os.getpid()}", flush=True)
sys.argv = ["hydraddp", *sys.argv[2:]]
runpy.run_module("hydraddp", run_name="__main__")
"""


def test_the_tracker_is_forked_from_the_launcher_and_keeps_none_of_its_exit_handlers(tmp_path):
    from mlflow.tracking import MlflowClient

    from tests.helpers.spawn import run_process

    db = tmp_path / "mlflow.db"
    done = run_process([sys.executable, "-c", CALLER, str(tmp_path), "trainer.max_steps=5", "trainer.log_every=1",
                        f"tracking.uri=sqlite:///{db}", f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "tracker").read_text() == "nice 19 own group True launcher's session True"
    caller = done.stdout.split("caller pid ")[1].split()[0]
    assert (tmp_path / "exit_handlers_run_by").read_text().split() == [caller]  # the tracker's exit ran none of them
    client = MlflowClient(f"sqlite:///{db}")
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5]
    assert {"config.yaml", "plan.json", "wrap_report.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    [model] = client.search_logged_models([run.info.experiment_id])
    assert model.source_run_id == run.info.run_id
