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


# Python code that calls the CLI after importing torch (a notebook, a warm process that forks launches: the tests'
# own, tests/helpers/zygote.py), recording whether the tracker was forked and who ran its exit handlers.
CALLER_WITH_TORCH = """
import atexit, os, runpy, sys
from pathlib import Path
import torch
import hydraddp.tracking.process as process
out = Path(sys.argv[1])
atexit.register(lambda: (out / "exit_handlers_run_by").open("a").write(f"{os.getpid()}\\n"))
fork = process._forked_tracker
def recorded():
    (out / "tracker_forked").touch()
    return fork()
process._forked_tracker = recorded
print(f"caller pid {os.getpid()}", flush=True)
sys.argv = ["hydraddp", *sys.argv[2:]]
runpy.run_module("hydraddp", run_name="__main__")
"""


def test_a_launcher_that_imported_torch_forks_its_tracker_which_keeps_none_of_the_launchers_exit_handlers(tmp_path):
    from mlflow.tracking import MlflowClient

    from tests.helpers.spawn import run_process

    db = tmp_path / "mlflow.db"
    done = run_process([sys.executable, "-c", CALLER_WITH_TORCH, str(tmp_path), "trainer.max_steps=5",
                        "trainer.log_every=1", f"tracking.uri=sqlite:///{db}", f"hydra.run.dir={tmp_path / 'job'}"],
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "tracker_forked").exists()
    caller = done.stdout.split("caller pid ")[1].split()[0]
    assert (tmp_path / "exit_handlers_run_by").read_text().split() == [caller]  # the tracker's exit ran none of them
    client = MlflowClient(f"sqlite:///{db}")
    [run] = client.search_runs([client.get_experiment_by_name("hydraddp").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5]
    assert {"config.yaml", "plan.json", "wrap_report.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    [model] = client.search_logged_models([run.info.experiment_id])
    assert model.source_run_id == run.info.run_id
