"""The plan every tracked launch records is made beside the workers, by a process that must never take a core from a
rank (``SCHED_IDLE``): ``python -m hydraddp.plan.record``, which prints the plan of the config it is sent, or, where
the launcher forks its workers, a fork of the launcher (``Recording``), which writes it where the run looks for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import textwrap

import pytest
from omegaconf import OmegaConf

from hydraddp.config.compose import compose

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE is Linux's")
def test_the_planning_process_runs_at_idle_priority_and_prints_the_plan():
    config = OmegaConf.to_container(compose(["backend=gloo", "wrap=fsdp2", "launcher.nproc_per_node=2"]),
                                    resolve=True)
    proc = subprocess.Popen([sys.executable, "-m", "hydraddp.plan.record"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # It lowers its priority first thing, then waits for its request on stdin.
        deadline = time.monotonic() + 30
        while os.sched_getscheduler(proc.pid) != os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        out, err = proc.communicate(json.dumps({"config": config, "world_size": 2}), timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    plan = json.loads(out)
    assert "error" not in plan, plan
    assert plan["wrap"] == "fsdp2" and plan["world_size"] == 2 and plan["peak_bytes"] > plan["param_bytes"] > 0


FORKING_LAUNCHER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path

    import torch
    from omegaconf import OmegaConf

    from hydraddp.config.compose import compose
    from hydraddp.plan.record import Recording

    config = OmegaConf.to_container(compose(["backend=gloo", "wrap=fsdp2", "launcher.nproc_per_node=2"]), resolve=True)
    tracker_stdin, launcher_end = os.pipe()  # as the launcher holds its tracker's stdin
    pipe = os.readlink(f"/proc/self/fd/{launcher_end}")
    recording = Recording(config, 2, Path(sys.argv[1]), fork=True)
    while os.sched_getscheduler(recording._proc.pid) != os.SCHED_IDLE:  # it lowers its priority once it closed them
        time.sleep(0.005)
    held = [os.readlink(f"/proc/{recording._proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{recording._proc.pid}/fd")]
    print(pipe in held, flush=True)
    recording.wait(120)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE is Linux's")
def test_a_launcher_that_forks_its_workers_forks_its_plan_at_idle_priority_holding_none_of_its_pipes(tmp_path):
    """The tracker learns that its launcher died when its stdin closes: a forked plan process that kept a copy of the
    launcher's end would hide that until the plan is done."""
    stale = tmp_path / "plan.json"
    stale.write_text('{"wrap": "an earlier launch\'s"}')
    done = subprocess.run([sys.executable, "-c", FORKING_LAUNCHER, str(stale)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]  # idle, and without the launcher's end of the tracker's stdin
    plan = json.loads(stale.read_text())
    assert plan["wrap"] == "fsdp2" and plan["world_size"] == 2 and plan["peak_bytes"] > plan["param_bytes"] > 0
    assert [path.name for path in tmp_path.iterdir()] == ["plan.json"]  # written whole: no partial file left


def test_a_recording_that_is_cancelled_leaves_no_plan_and_no_process(tmp_path):
    from hydraddp.plan.record import Recording

    config = OmegaConf.to_container(compose(["backend=gloo", "wrap=ddp", "launcher.nproc_per_node=2"]), resolve=True)
    recording = Recording(config, 2, tmp_path / "plan.json", fork=False)  # a fresh process: this one has threads
    pid = recording._proc.pid
    recording.cancel()
    assert recording._proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not (tmp_path / "plan.json").exists()
