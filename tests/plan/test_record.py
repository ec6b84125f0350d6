"""The plan every tracked launch records is made by ``python -m hydraddp.plan.record``, which the tracker starts beside
the workers: it must never take a core from a rank (``SCHED_IDLE``), and it prints the plan of the config it is sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from hydraddp.config.compose import compose

pytestmark = pytest.mark.slow  # launches for real: see README, Tests


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
