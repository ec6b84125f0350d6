"""One launch at a time in a checkpoint root: the process that leads a launch holds an exclusive ``flock`` on ``CLAIM``
in its ``checkpoint.dir`` from preflight until the launch ends, and records there who it is. A second launch finds it
held and is refused before any worker starts. The kernel drops the lock when its holder exits, however it exits, so
a crashed launch never blocks a later resume, and a restarted rank 0 under torchrun takes it again."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
CLAIM = ".hydraddp-claim"

_held: dict[Path, int] = {}  # root -> this process's open, locked claim file


def claim(root: Path, job_dir: Path) -> dict[str, Any] | None:
    """Claim ``root`` for the launch of ``job_dir`` until ``release``. None when this process holds it now; else
    what the launch holding it recorded (``job_dir``, ``host``, ``pid``, ``since``; empty while it is writing them)."""
    root = Path(root)
    if root in _held:
        return None
    root.mkdir(parents=True, exist_ok=True)
    path = root / CLAIM
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return holder(root)
            # A file system without locks (some NFS mounts): training there is no less safe than it was.
            log.warning("checkpoint.dir=%s cannot be locked (%s): a concurrent launch into it is not refused",
                        root, exc)
            return None
        if _is_path(fd, path):
            break
        os.close(fd)  # its holder removed it between our open and our lock: that file claims nothing now
    record = {"job_dir": str(job_dir), "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(record).encode())
    _held[root] = fd
    return None


def _is_path(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def holder(root: Path) -> dict[str, Any]:
    """What the launch claiming ``root`` recorded ({} when nothing is readable)."""
    try:
        return json.loads((Path(root) / CLAIM).read_text())
    except (OSError, ValueError):
        return {}


def release(root: Path | None = None) -> None:
    """Give up the claim on ``root`` (None: every claim this process holds), removing the file first: a launch that
    opened it meanwhile finds another file there (or none) and claims that one instead."""
    for held in list(_held) if root is None else [Path(root)]:
        fd = _held.pop(held, None)
        if fd is None:
            continue
        try:
            os.unlink(held / CLAIM)
        except OSError:
            pass  # removed by hand: the lock is still dropped below
        os.close(fd)
