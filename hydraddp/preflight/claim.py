"""One launch at a time in a checkpoint root: the process that leads a launch holds the lease ``CLAIM`` in its
``checkpoint.dir`` (``hydraddp.lease``: a file created with O_EXCL, renewed while its holder lives) from preflight
until the launch ends, and records there who it is. A second launch, on this node or another, finds it held and is
refused before any worker starts. Not ``flock``: on common cluster mounts it locks on each node alone. A launch
that crashed frees the folder at once for a launch on its host (its pid is gone: a restarted rank 0 under torchrun
takes it again), and for one on another node once its lease expires (``lease.DURATION_S``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydraddp import lease

log = logging.getLogger(__name__)
CLAIM = ".hydraddp-claim"

_held: dict[Path, lease.Lease] = {}  # root -> this process's lease on it


def claim(root: Path, job_dir: Path, restarted: bool = False) -> dict[str, Any] | None:
    """Claim ``root`` for the launch of ``job_dir`` until ``release``. None when this process holds it now; else
    what the launch holding it recorded (``job_dir``, ``host``, ``pid``, ``since``; empty while it is writing them).
    ``restarted``: torch's agent restarted this launch, whose earlier attempt held the claim; it is taken at once,
    also when that attempt's rank 0 ran on a node that is gone (an elastic job that lost it)."""
    root = Path(root)
    if root in _held:
        return None
    root.mkdir(parents=True, exist_ok=True)
    try:
        taken = lease.acquire(root / CLAIM, job_dir=str(job_dir), succeeds_own=restarted)
    except OSError as exc:
        # A folder this process cannot create a file in: training there fails on its own, with its own error.
        log.warning("checkpoint.dir=%s cannot be claimed (%s): a concurrent launch into it is not refused", root, exc)
        return None
    if taken is None:
        return holder(root)
    _held[root] = taken
    return None


def holder(root: Path) -> dict[str, Any]:
    """What the launch claiming ``root`` recorded ({} when nothing is readable)."""
    return lease.holder(Path(root) / CLAIM)


def release(root: Path | None = None) -> None:
    """Give up the claim on ``root`` (None: every claim this process holds), removing its file if it is still this
    process's lease: a launch waiting for it then claims it."""
    for held in list(_held) if root is None else [Path(root)]:
        taken = _held.pop(held, None)
        if taken is not None:
            taken.release()
