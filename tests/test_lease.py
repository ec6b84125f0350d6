"""A lease (``hydraddp.lease``) has one holder at a time across real processes, with ``fcntl.flock`` made a no-op
that always succeeds in every one of them, as on NFS with ``local_lock`` (or Lustre ``localflock``): the property
the lease exists for. A holder killed with SIGKILL is taken over (on its host at once; from another host once its
lease expires), a live holder's renewals keep it, and only its holder removes it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hydraddp import lease
from tests.helpers.spawn import REPO, assert_no_orphans, child_env

# A racer: flock a no-op, then commands on stdin, one answer line each: "acquire PATH" -> won|lost,
# "claim ROOT JOB_DIR" -> won|lost (the checkpoint.dir claim), "release" -> released.
# argv[1]: JSON settings: the lease's DURATION_S / RENEW_S, and "host" (another node's name for this process).
RACER = """
import fcntl, json, socket, sys
fcntl.flock = lambda *args, **kwargs: None  # as on NFS local_lock: every process gets every lock at once
from pathlib import Path
from hydraddp import lease
settings = json.loads(sys.argv[1])
if "host" in settings:
    socket.gethostname = lambda: settings["host"]
lease.DURATION_S, lease.RENEW_S = settings.get("duration", lease.DURATION_S), settings.get("renew", lease.RENEW_S)
held = None
for line in sys.stdin:
    command, *args = line.split()
    if command == "acquire":
        held = lease.acquire(Path(args[0]))
        print("won" if held else "lost", flush=True)
    elif command == "claim":
        from hydraddp.preflight import claim
        won = claim.claim(Path(args[0]), Path(args[1])) is None
        print("won" if won else "lost", flush=True)
    elif command == "release":
        if held:
            held.release()
        if "hydraddp.preflight.claim" in sys.modules:
            sys.modules["hydraddp.preflight.claim"].release()
        held = None
        print("released", flush=True)
"""


class Racers:
    """``n`` racer processes, each in its own session, all with one test token (the no-orphan check)."""

    def __init__(self, n: int, **settings):
        self.token = uuid.uuid4().hex
        self.procs = [subprocess.Popen([sys.executable, "-c", RACER, json.dumps(settings)], cwd=REPO,
                                       env=child_env(self.token), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, start_new_session=True) for _ in range(n)]

    def ask(self, command: str, procs: list[subprocess.Popen] | None = None) -> list[str]:
        """Send ``command`` to every racer first (so that they race), then read every answer."""
        procs = procs or self.procs
        for proc in procs:
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        return [proc.stdout.readline().strip() for proc in procs]

    def kill(self, proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGKILL)  # a crash: nothing of the holder's own code runs
        proc.wait()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill(proc)
        assert_no_orphans(self.token)

    def __enter__(self) -> Racers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def gone_holders_lease(path: Path) -> None:
    """A lease another node's process held, expired a minute ago (that node died)."""
    now = time.time()
    path.write_text(json.dumps({"job_dir": "/jobs/dead", "host": "a-dead-node", "pid": 1, "token": uuid.uuid4().hex,
                                "since": now - 120, "renewed": now - 120, "expires": now - 60}))


def test_racing_processes_one_wins_each_time_also_taking_over_an_expired_lease(tmp_path):
    leases = tmp_path / "leases"
    leases.mkdir()
    with Racers(3) as racers:
        for round in range(40):
            path = leases / f"lease{round}"
            if round % 2:  # every other round the racers race to take over a dead node's lease
                gone_holders_lease(path)
            answers = racers.ask(f"acquire {path}")
            assert sorted(answers) == ["lost", "lost", "won"], (round, answers)
            winner = racers.procs[answers.index("won")]
            assert lease.holder(path)["pid"] == winner.pid and lease.acquire(path) is None
            assert racers.ask("release") == ["released"] * 3
    assert list(leases.iterdir()) == []  # no lease, renewal or takeover file left


def test_a_holder_killed_on_this_host_is_taken_over_at_once(tmp_path):
    path = tmp_path / "lease"
    with Racers(1) as racers:  # the lease's own minute: only its dead pid frees it now
        assert racers.ask(f"acquire {path}") == ["won"]
        held = lease.holder(path)
        racers.kill(racers.procs[0])
    taken = lease.acquire(path)
    assert taken is not None and time.time() < held["expires"]
    assert lease.holder(path)["pid"] == os.getpid()
    taken.release()
    assert list(tmp_path.iterdir()) == []


def test_a_dead_pid_frees_a_lease_only_in_its_own_pid_namespace(tmp_path):
    """Containers on one host may share its name, not their pids: there, a pid this process cannot see may live."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path, now = tmp_path / "lease", time.time()
    record = {"job_dir": "/jobs/a", "host": socket.gethostname(), "pid": int(dead.stdout), "token": uuid.uuid4().hex,
              "since": now, "renewed": now, "expires": now + 600}
    path.write_text(json.dumps({**record, "pid_namespace": -1}))  # another container's
    assert lease.acquire(path) is None
    path.write_text(json.dumps({**record, "pid_namespace": os.stat("/proc/self/ns/pid").st_ino}))
    taken = lease.acquire(path)
    assert taken is not None
    taken.release()


def test_a_holder_killed_on_another_node_is_taken_over_once_its_lease_expires(tmp_path):
    path = tmp_path / "lease"
    with Racers(1, host="other-node", duration=5.0, renew=0.5) as racers:
        assert racers.ask(f"acquire {path}") == ["won"]
        racers.kill(racers.procs[0])
    held = lease.holder(path)  # its last renewal
    assert held["host"] == "other-node"
    # Its pid means nothing on this host: the lease holds until it expires, then the first to ask takes it.
    assert lease.acquire(path) is None or time.time() > held["expires"]
    deadline = time.monotonic() + 60
    while (taken := lease.acquire(path)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert time.time() > held["expires"] and lease.holder(path)["host"] == socket.gethostname()
    taken.release()


def test_a_restarted_launch_takes_its_own_claim_from_a_lost_node_at_once_and_no_other_launch_does(tmp_path):
    """An elastic job that lost rank 0's node goes on with rank 0 on another node: that restart claims its own
    ``checkpoint.dir`` at once, though the lost node's lease has not expired; a restart of another launch, or a
    launch that is no restart, is still refused until it does."""
    from hydraddp.preflight import claim

    root = tmp_path / "ckpt"
    with Racers(1, host="lost-node") as racers:  # the lease lasts its default minute
        assert racers.ask(f"claim {root} /jobs/a") == ["won"]
        racers.kill(racers.procs[0])
    assert claim.claim(root, Path("/jobs/a"))["host"] == "lost-node"  # no restart: refused
    assert claim.claim(root, Path("/jobs/b"), restarted=True)["host"] == "lost-node"  # another launch's restart
    assert claim.claim(root, Path("/jobs/a"), restarted=True) is None
    assert claim.holder(root)["host"] == socket.gethostname() and claim.holder(root)["job_dir"] == "/jobs/a"
    claim.release(root)
    assert not (root / claim.CLAIM).exists()


def test_renewals_keep_a_live_holders_lease_past_its_duration(tmp_path):
    path = tmp_path / "lease"
    with Racers(1, host="other-node", duration=2.0, renew=0.2) as racers:
        assert racers.ask(f"acquire {path}") == ["won"]
        first = lease.holder(path)
        while time.time() < first["expires"] + 1.0:
            time.sleep(0.1)
        assert lease.acquire(path) is None  # past its first expiry, its holder still has it
        now = lease.holder(path)
        assert now["token"] == first["token"] and now["expires"] > first["expires"]
        assert racers.ask("release") == ["released"]
        assert not path.exists()


def test_release_by_a_process_that_lost_the_lease_leaves_the_new_holders(tmp_path, monkeypatch):
    path = tmp_path / "lease"
    monkeypatch.setattr(lease, "DURATION_S", 0.5)
    monkeypatch.setattr(lease, "RENEW_S", 600.0)  # it stalls: no renewal
    stalled = lease.acquire(path)
    while time.time() <= stalled.record["expires"]:
        time.sleep(0.05)
    taker = lease.acquire(path)  # expired: taken over, though its holder (this process) lives
    assert taker is not None and taker.token != stalled.token
    assert not stalled._renew()  # its renewal sees the lease is not its own, and does not write
    stalled.release()
    assert lease.holder(path)["token"] == taker.token
    taker.release()
    assert list(tmp_path.iterdir()) == []


def test_a_lease_never_written_is_its_creators_for_a_lease_duration(tmp_path):
    path = tmp_path / "lease"
    path.touch()  # a holder between its O_EXCL creation and its record (or one that died there)
    assert lease.acquire(path) is None and lease.holder(path) == {}
    old = time.time() - lease.DURATION_S - 1
    os.utime(path, (old, old))
    taken = lease.acquire(path)
    assert taken is not None
    taken.release()


def test_waiting_for_a_held_lease_times_out_naming_the_lease_and_its_holder(tmp_path, monkeypatch):
    path = tmp_path / "mlflow.db.lease"
    monkeypatch.setattr(lease, "POLL_S", 0.01)
    holding = lease.acquire(path, job_dir="/jobs/a")
    try:
        with pytest.raises(lease.LeaseTimeout) as raised:
            with lease.held(path, timeout_s=0.2):
                pass
        message = str(raised.value)
        assert f"the lease {path}, held by host {socket.gethostname()}, pid {os.getpid()}, job_dir /jobs/a" in message
        assert f"if it is gone, remove {path}" in message
    finally:
        holding.release()
    with lease.held(path) as mine:  # free again: no wait
        assert lease.holder(path)["token"] == mine.token
    assert not path.exists()


def _create_study(storage: str, start, results) -> None:
    import fcntl

    fcntl.flock = lambda *args, **kwargs: None  # as on NFS local_lock: every process gets every lock at once
    import optuna

    from hydraddp.search.storage import creating

    start.wait()
    try:
        with creating(storage):
            study = optuna.create_study(study_name="shared", storage=storage, load_if_exists=True)
        results.put(("ok", study._study_id))
    except Exception as exc:  # noqa: BLE001 - the test reports what failed in which process
        results.put(("failed", f"{type(exc).__name__}: {exc}"))


def test_sweepers_creating_one_study_at_once_on_a_mount_without_locks_share_it(tmp_path):
    """The study's lease (``search.storage.creating``) in real processes started together, flock a no-op in each."""
    import multiprocessing

    optuna = pytest.importorskip("optuna")
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    sweepers = [context.Process(target=_create_study, args=(storage, start, results)) for _ in range(3)]
    for process in sweepers:
        process.start()
    start.set()
    outcomes = [results.get(timeout=120) for _ in sweepers]
    for process in sweepers:
        process.join(timeout=60)
    assert [status for status, _ in outcomes] == ["ok"] * 3 and len({id for _, id in outcomes}) == 1, outcomes
    assert [s.study_name for s in optuna.get_all_study_summaries(storage)] == ["shared"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optuna.db"]
