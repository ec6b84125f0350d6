"""A launch claims its ``checkpoint.dir`` for as long as it runs: another launch into it meanwhile is refused with the
holder named, and a holder that dies (SIGKILL included) leaves the folder free. The holder is a real second process:
the kernel's lock is what is checked."""

import os
import signal
import subprocess
import sys
import uuid

from omegaconf import OmegaConf

from hydraddp.preflight import claim
from hydraddp.preflight.launch import checkpoint_root_problems
from tests.helpers.spawn import REPO, assert_no_orphans, child_env

HOLD = ("import sys, time; from hydraddp.preflight import claim; "
        "assert claim.claim(sys.argv[1], '/jobs/first') is None; print('claimed', flush=True); time.sleep(120)")


def held_elsewhere(root):
    token = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], cwd=REPO, env=child_env(token),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc, token


def test_a_claimed_checkpoint_dir_refuses_another_launch_until_its_holder_dies(tmp_path):
    root = tmp_path / "shared"
    cfg = OmegaConf.create({"checkpoint": {"dir": str(root)}})
    proc, token = held_elsewhere(root)
    try:
        [problem] = checkpoint_root_problems(cfg, tmp_path / "second", None, restarted=False)
        text = str(problem)
        assert f"checkpoint.dir={root} is in use by another launch that is running now" in text
        assert f"job_dir /jobs/first, host {os.uname().nodename}, pid {proc.pid}" in text
        assert "Give this launch its own checkpoint.dir" in text and "checkpoint.resume=latest" in text
        # A restart of this launch is refused too: the folder is not its to write while the other holds it.
        assert checkpoint_root_problems(cfg, tmp_path / "second", None, restarted=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # a crash: nothing of the holder's own code runs
        proc.wait()
        assert_no_orphans(token)
    assert claim.holder(root)["job_dir"] == "/jobs/first"  # its record is left, its lock is not
    try:
        assert checkpoint_root_problems(cfg, tmp_path / "second", None, restarted=False) == []
        assert claim.holder(root)["job_dir"] == str(tmp_path / "second")
    finally:
        claim.release()
    assert list(root.iterdir()) == []


def test_a_launch_without_checkpoint_dir_claims_nothing(tmp_path):
    cfg = OmegaConf.create({"checkpoint": {"dir": None}})
    assert checkpoint_root_problems(cfg, tmp_path / "job", None, restarted=False) == []
    assert claim._held == {} and list(tmp_path.iterdir()) == []
