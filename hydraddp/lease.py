"""A lease on a file: one holder at a time among the processes of every node that sees the file, without ``flock``.

On common cluster mounts (NFS with ``local_lock``, Lustre ``localflock``, BeeGFS) ``flock`` locks on each node alone:
a process on every node gets it at once, silently. A lease is a file created with ``O_CREAT|O_EXCL``, atomic on
NFSv3+, Lustre and BeeGFS: whoever creates it holds it. It records its holder (host, pid, job_dir, a unique token)
and when it expires; a daemon thread renews it while the holder lives. Another process takes it over once it has
expired, or at once when its holder was a process of this host that is gone. Stdlib only: every layer may use it.

    lease = acquire(Path("/shared/ckpt/.hydraddp-claim"), job_dir="/jobs/a")  # None: another process holds it
    lease.release()
    with held(Path("/shared/mlflow.db.lease")):  # waits its turn, up to WAIT_S (then LeaseTimeout)
        ...
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, NamedTuple

log = logging.getLogger(__name__)

# A holder renews every RENEW_S; its lease lasts DURATION_S from its last renewal. Six renewals per lease ride out
# a loaded metadata server's slow or failed writes, and a launch whose node died frees its lease a minute later.
# The nodes' clocks (NTP: milliseconds apart) must agree to well under DURATION_S. Tests shorten both.
DURATION_S = 60.0
RENEW_S = 10.0
POLL_S = 0.1  # how often ``held`` looks again: the sections it guards take a second or two
WAIT_S = 300.0  # how long ``held`` waits: a dead holder's lease is free within DURATION_S, so this one is stuck
_ATTEMPTS = 5  # creations tried in one ``acquire`` while others release or take over the same lease


class LeaseTimeout(TimeoutError):
    """``held`` waited ``WAIT_S`` while another process held the lease (and kept renewing it)."""


class _Seen(NamedTuple):
    record: dict[str, Any]  # {} while its holder is writing it (or died before it could)
    identity: str | None  # this very file and content (None: no file); a renewal or a new holder changes it
    mtime: float


class Lease:
    """This process's hold on ``path``, renewed by a daemon thread until ``release``. ``lost`` turns true when a
    renewal finds that the lease is no longer ours (taken over after this process stalled past its expiry)."""

    def __init__(self, path: Path, record: dict[str, Any], duration_s: float):
        self.path, self.record, self.duration_s = path, record, duration_s
        self.token: str = record["token"]
        self.lost = False
        self._renewed = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_until_released, name=f"lease {path}", daemon=True)
        self._thread.start()

    def _renew_until_released(self) -> None:
        while not self._stop.wait(RENEW_S):
            if not self._renew():
                self.lost = True
                log.error("lost the lease %s (now %s): another process may now do what it guards", self.path,
                          describe(holder(self.path)))
                return

    def _renew(self) -> bool:
        """Rewrite the record with a new expiry; False once the lease is not ours."""
        started = time.monotonic()
        # Past its expiry less one period, another process may have taken it: writing now could overwrite its lease.
        if started - self._renewed > self.duration_s - RENEW_S:
            return False
        try:
            if _read(self.path).record.get("token") != self.token:
                return False
            now = time.time()
            record = {**self.record, "renewed": now, "expires": now + self.duration_s}
            temporary = self.path.with_name(f"{self.path.name}.{self.token}.renew")
            temporary.write_text(json.dumps(record))
            os.replace(temporary, self.path)  # the content changes at once; O_EXCL creation stays the arbiter
        except OSError as exc:  # a file server's hiccup: the next period tries again
            log.warning("could not renew the lease %s: %s", self.path, exc)
            return True
        self.record, self._renewed = record, started
        return True

    def release(self) -> None:
        """Stop renewing, and remove the lease if it is still ours (a lease another process took over stays)."""
        if os.getpid() != self.record["pid"]:
            return  # a forked child's copy: the lease is its parent's
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with contextlib.suppress(OSError):
            if _read(self.path).record.get("token") == self.token:
                os.unlink(self.path)


def acquire(path: Path, job_dir: str = "", succeeds_own: bool = False) -> Lease | None:
    """Take the lease on ``path`` when it is free or its holder is gone; None while another process holds it.
    ``succeeds_own``: this process goes on with ``job_dir``'s work after its earlier holder ended (a restart of the
    same launch: torch's agent restarted the group), so a lease held for ``job_dir`` is taken at once, on whichever
    node that holder ran.

    >>> lease = acquire(Path("/shared/ckpt/.hydraddp-claim"), job_dir="/jobs/a")
    """
    path = Path(path)
    for _ in range(_ATTEMPTS):
        duration = DURATION_S
        record = _create(path, job_dir, duration)
        if record is not None:
            return Lease(path, record, duration)
        seen = _read(path)
        if seen.identity is None:
            continue  # released meanwhile: create it again
        if not (_gone(seen) or succeeds_own and job_dir and seen.record.get("job_dir") == job_dir):
            return None
        _take_over(path, seen)  # at most one taker removes it; then every taker tries to create it
    return None


@contextlib.contextmanager
def held(path: Path, job_dir: str = "", timeout_s: float | None = None) -> Iterator[Lease]:
    """Hold the lease on ``path`` for a ``with`` block, waiting (polling every ``POLL_S``) while another process
    holds it; ``LeaseTimeout`` names the holder after ``timeout_s`` (default ``WAIT_S``).

    >>> with held(Path("/shared/mlflow.db.lease")):
    ...     create_the_store()
    """
    timeout_s = WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while (lease := acquire(path, job_dir)) is None:
        if time.monotonic() > deadline:
            raise LeaseTimeout(
                f"waited {timeout_s:.0f} s for the lease {path}, held by {describe(holder(path))}, which keeps "
                f"renewing it. Wait until that process ends (or end it); if it is gone, remove {path}.")
        time.sleep(POLL_S)
    try:
        yield lease
    finally:
        lease.release()


def holder(path: Path) -> dict[str, Any]:
    """What the holder of the lease on ``path`` recorded ({} when there is none, or while it is writing it)."""
    try:
        return _read(Path(path)).record
    except OSError:
        return {}


def describe(record: dict[str, Any]) -> str:
    """A holder in words, for messages."""
    who = ", ".join(f"{key} {record[key]}" for key in ("host", "pid", "job_dir") if record.get(key))
    return who or "a process that is creating it now"


def _create(path: Path, job_dir: str, duration_s: float) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    now = time.time()
    record = {"job_dir": job_dir, "host": socket.gethostname(), "pid": os.getpid(), "pid_namespace": _pid_namespace(),
              "token": uuid.uuid4().hex, "since": now, "renewed": now, "expires": now + duration_s}
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


def _read(path: Path) -> _Seen:
    try:
        with open(path, "rb") as file:
            raw, info = file.read(), os.fstat(file.fileno())
    except FileNotFoundError:
        return _Seen({}, None, 0.0)
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    identity = hashlib.sha1(b"%d:" % info.st_ino + raw).hexdigest()[:16]
    return _Seen(record if isinstance(record, dict) else {}, identity, info.st_mtime)


def _gone(seen: _Seen) -> bool:
    """Its holder is gone: a process of this host that is dead, or any holder past its expiry."""
    record, now = seen.record, time.time()
    if not isinstance(record.get("expires"), (int, float)):  # created, not yet written: its holder died in between
        return now - seen.mtime > DURATION_S  # (or is writing it now)
    # Its pid means something only where its pids do: its host, and its container's pid namespace there.
    here = record.get("host") == socket.gethostname() and record.get("pid_namespace") == _pid_namespace()
    if here and not alive(record.get("pid")):
        return True
    return now > record["expires"]


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def alive(pid: Any) -> bool:
    """Whether process ``pid`` of this host (and pid namespace) runs: a zombie its parent has not reaped is dead."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process its parent has not reaped yet is dead too
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _take_over(path: Path, seen: _Seen) -> None:
    """Remove the gone holder's lease ``seen`` (only that one: a lease renewed or replaced meanwhile stays). Of
    several takers at once one removes it: each first creates a marker named after ``seen`` with O_EXCL, and looks
    again under it. A marker whose taker died while at it is old: the next taker creates the next marker."""
    for n in itertools.count():
        marker = path.with_name(f"{path.name}.takeover-{seen.identity}-{n}")
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            break
        except FileExistsError:
            try:
                if time.time() - os.stat(marker).st_mtime < DURATION_S:
                    return  # another taker is at it: the caller looks again
            except FileNotFoundError:
                return  # that taker is done
    try:
        if _read(path).identity == seen.identity:
            os.unlink(path)
            with contextlib.suppress(FileNotFoundError):  # a renewal its holder died in the middle of
                os.unlink(path.with_name(f"{path.name}.{seen.record.get('token')}.renew"))
    finally:
        for left in glob.glob(f"{glob.escape(str(path))}.takeover-{seen.identity}-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(left)
