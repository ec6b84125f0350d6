"""The ranks of an attached launch without torch's agent (srun, submitit, RANK/WORLD_SIZE by hand) meet on rank 0's
store before their process group forms. A rank that refuses to start (``refuse``: preflight on a requeue, a bad
checkpoint) or never comes ends every rank within ``launcher.timeout`` (``GroupNotFormedError``), where torch alone
would wait its 30 minutes and end in a traceback, or, with rank 0 gone before it hosts the store, never."""

from __future__ import annotations

import datetime
import json
import os
import time

import torch.distributed as dist

from hydraddp.distributed import store_client
from hydraddp.distributed.env import DEFAULT_MASTER_PORT, JOIN_TIMEOUT_ENV, LaunchEnv, detect_launch_env


class GroupNotFormedError(RuntimeError):
    """The process group did not form: rank ``refused_by`` refused to start (``reason``), or the ranks in ``missing``
    did not join within ``timeout_s``. The cause is in that rank's own log, not in this one's."""

    def __init__(self, timeout_s: float, missing: tuple[int, ...] = (), refused_by: int | None = None,
                 reason: str = ""):
        self.timeout_s, self.missing, self.refused_by, self.reason = timeout_s, missing, refused_by, reason
        who = refused_by if refused_by is not None else ", ".join(map(str, missing))
        what = f"refused to start: {reason}" if refused_by is not None else f"did not join within {timeout_s:g} s"
        super().__init__(f"rank {who} {what}: see rank {refused_by if refused_by is not None else missing[0]}'s log")


# Keys of the meeting on rank 0's store before the group forms (``join``, ``refuse``).
_JOINED, _REFUSED, _SEEN = "hydraddp/join/rank", "hydraddp/join/refused", "hydraddp/join/seen"
_POLL_S = 0.1
_ALONE_S = 15.0


def join_timeout(timeout: datetime.timedelta | None) -> datetime.timedelta:
    """How long the ranks wait for each other to form the group: ``timeout`` when given, else the launch's
    ``launcher.timeout`` (the CLI puts it in the environment), else torch's default."""
    if timeout is not None:
        return timeout
    seconds = os.environ.get(JOIN_TIMEOUT_ENV, "")
    return datetime.timedelta(seconds=float(seconds)) if seconds else dist.default_pg_timeout


def _rendezvous(launch: LaunchEnv) -> tuple[str, int]:
    """Where rank 0's store listens: ``MASTER_ADDR``/``MASTER_PORT``, else what the launcher's variables imply."""
    addr = os.environ.get("MASTER_ADDR") or launch.master_addr or "127.0.0.1"
    port = os.environ.get("MASTER_PORT") or launch.master_port or DEFAULT_MASTER_PORT
    return addr, int(port)


def _meeting_store(launch: LaunchEnv, addr: str, port: int, timeout: datetime.timedelta,
                   deadline: float) -> dist.Store:
    """Rank 0's store: hosted by rank 0, the others connect once it listens (``store_client``). ``timeout`` is the
    launch's, named in the error (under load, a long knock used to report its remaining part as the timeout, e.g.
    19.9991 s for 20)."""
    remaining = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0))
    if launch.rank != 0:
        try:
            return store_client.connect(addr, port, remaining)
        except store_client.StoreUnreachableError:
            raise GroupNotFormedError(timeout.total_seconds(), (0,)) from None
    return dist.TCPStore(addr, port, launch.world_size, is_master=True, timeout=remaining, wait_for_workers=False,
                         multi_tenant=True)


def _acknowledge(store: dist.Store, launch: LaunchEnv, deadline: float) -> None:
    """Every rank learns of a refusal from rank 0's store, which lives as long as rank 0: the others count themselves
    as told and go; rank 0 stays until all are told, or the timeout, or ``_ALONE_S`` if none came at all (a task
    started alone: srun's others come within seconds of rank 0's preflight, and any later are ended by the timeout)."""
    if launch.rank != 0:
        store.add(_SEEN, 1)
        return
    alone_until = time.monotonic() + _ALONE_S
    while (seen := int(store.add(_SEEN, 0))) < launch.world_size - 1 and time.monotonic() < deadline \
            and (seen or time.monotonic() < alone_until):
        time.sleep(_POLL_S)


def join(launch: LaunchEnv, addr: str, port: int, timeout: datetime.timedelta) -> dist.Store:
    """Meet every rank on rank 0's store before the group forms. A rank that refused to start (``refuse``), or that
    never came, ends every rank within ``timeout`` (``GroupNotFormedError``), instead of a wait of torch's 30 min
    that ends in a traceback, or never (rank 0 hosts the store: without it the others knock until cancelled)."""
    deadline = time.monotonic() + timeout.total_seconds()
    store = _meeting_store(launch, addr, port, timeout, deadline)
    store.set(f"{_JOINED}/{launch.rank}", "1")
    everyone = [f"{_JOINED}/{rank}" for rank in range(launch.world_size)]
    while not store.check(everyone):
        if store.check([_REFUSED]):
            refused_by, reason = json.loads(store.get(_REFUSED))
            _acknowledge(store, launch, deadline)
            raise GroupNotFormedError(timeout.total_seconds(), refused_by=refused_by, reason=reason)
        if time.monotonic() > deadline:
            missing = tuple(rank for rank, key in enumerate(everyone) if not store.check([key]))
            raise GroupNotFormedError(timeout.total_seconds(), missing)
        time.sleep(_POLL_S)
    return store


def refuse(reason: str, timeout: datetime.timedelta) -> None:
    """This rank of an attached launch (srun, submitit) will not start: tell the others, which wait for it on rank
    0's store (``join``), so that they end now rather than at the timeout. Rank 0, which hosts the store, returns
    once every rank was told (or at the timeout). Under torch's elastic agent (torchrun) it does nothing: the agent
    stops the other workers when one exits."""
    launch = detect_launch_env()
    under_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if launch is None or launch.world_size == 1 or under_agent:
        return
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        store = _meeting_store(launch, *_rendezvous(launch), timeout, deadline)
    except (GroupNotFormedError, RuntimeError):
        return  # no rank 0 to tell the others: their own timeout ends them
    store.compare_set(_REFUSED, "", json.dumps([launch.rank, reason]))  # the first refusal is the one they report
    _acknowledge(store, launch, deadline)
