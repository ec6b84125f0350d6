"""A launch claims its ``checkpoint.dir`` for as long as it runs: another launch into it meanwhile is refused with the
holder named, and a holder that dies (SIGKILL included) leaves the folder free. The holders are real processes, and
the claim holds with ``fcntl.flock`` a no-op that always succeeds, as on NFS with ``local_lock``: the claim is a
lease (``hydraddp.lease``, tested on its own in tests/test_lease.py), not a lock of one node's kernel."""

import os
import signal
import subprocess
import sys
import uuid

from hydraddp.config.compose import compose
from hydraddp.preflight import claim
from hydraddp.preflight.environment import checkpoint_root_problems
from hydraddp.preflight.settings import Settings, complete
from tests.helpers.spawn import REPO, assert_no_orphans, child_env
from tests.test_lease import Racers

HOLD = ("import fcntl, sys, time; fcntl.flock = lambda *args, **kwargs: None; from hydraddp.preflight import claim; "
        "assert claim.claim(sys.argv[1], '/jobs/first') is None; print('claimed', flush=True); time.sleep(120)")


def settings_with(override: str) -> Settings:
    cfg = compose([override])
    complete(cfg)
    return Settings.of(cfg)


def held_elsewhere(root):
    token = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], cwd=REPO, env=child_env(token),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc, token


def test_a_claimed_checkpoint_dir_refuses_another_launch_until_its_holder_dies(tmp_path):
    root = tmp_path / "shared"
    cfg = settings_with(f"checkpoint.dir={root}")
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
    cfg = settings_with("checkpoint.dir=null")
    assert checkpoint_root_problems(cfg, tmp_path / "job", None, restarted=False) == []
    assert claim._held == {} and list(tmp_path.iterdir()) == []


def test_launches_racing_for_one_checkpoint_dir_on_a_mount_without_locks_one_claims_it(tmp_path):
    """Each round, three processes claim one folder at once (flock a no-op in each): one claims it, the others are
    refused; once it releases, the folder is free again."""
    root = tmp_path / "shared"
    with Racers(3) as racers:
        for round in range(10):
            answers = racers.ask(f"claim {root} /jobs/{round}")
            assert sorted(answers) == ["lost", "lost", "won"], (round, answers)
            assert claim.holder(root)["pid"] == racers.procs[answers.index("won")].pid
            assert racers.ask("release") == ["released"] * 3
            assert list(root.iterdir()) == []


def test_release_by_a_launch_that_does_not_hold_the_claim_leaves_it(tmp_path):
    root = tmp_path / "shared"
    proc, token = held_elsewhere(root)
    try:
        claim.release(root)
        claim.release()
        assert claim.holder(root)["pid"] == proc.pid and claim.claim(root, tmp_path / "second") is not None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert_no_orphans(token)
