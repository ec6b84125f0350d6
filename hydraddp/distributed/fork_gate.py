"""Forked workers connect to the agent's store only once the last worker of their round is forked.

The agent's store daemon, a thread of the launching process, names each client that connects with ``getnameinfo``
(c10d's ``LibUVStoreDaemon::onConnect``), which holds glibc's resolver lock. A worker forked at that moment starts with
the lock held by a thread it does not have: its own ``getnameinfo``, in its ``TCPStore`` connect, waits for it for good,
and its peers wait for its address in gloo's constructor. Seen on a loaded machine in about one 4-rank launch in 40
(py-spy --native, in the hung worker: ``__resolv_context_get`` <- ``gethostbyaddr_r`` <- ``getnameinfo`` <-
``c10d::detail::formatSockAddr`` <- ``SocketImpl::SocketImpl`` <- ``TCPClient::connect``).

Held back until their round is forked, no worker connects while the launcher forks, so no connection is being named at
a fork. Within one node nobody else connects to the agent's store; on several nodes, other nodes' workers do at any
time, so a multi-node launch spawns its workers (``elastic.worker_start_method``).

A round is the agent's ``workers_per_round`` forks, for its first start or for a restart. The launcher closes the
round's pipe after the last of them; each worker of the round reads the pipe to its end before it starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

WAIT_S = 300.0  # a round's forks take milliseconds; past this a worker goes on rather than hang on a miscount


class _Round:
    def __init__(self, size: int):
        self.size, self.forked = size, 0
        self.read_fd, self.write_fd = os.pipe()

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


_round: _Round | None = None  # in the launcher, while it forks workers
_inherited: int | None = None  # in a forked worker: the read end of its round's pipe


def _after_fork_in_parent() -> None:
    global _round
    if _round is None:
        return
    _round.forked += 1
    if _round.forked == _round.size:  # the round is forked: its workers go on; a restart's round gets a pipe of its own
        _round.close()
        _round = _Round(_round.size)


def _after_fork_in_child() -> None:
    global _round, _inherited
    if _round is None:
        return
    os.close(_round.write_fd)  # the pipe ends when the launcher's write end closes, not this copy's
    _inherited, _round = _round.read_fd, None  # the worker's own forks (its data loaders) are no round's


os.register_at_fork(after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def forking(workers_per_round: int) -> Iterator[None]:
    """While this process forks workers, ``workers_per_round`` at a time, each waits for its round (``wait``)."""
    global _round
    _round = _Round(workers_per_round)
    try:
        yield
    finally:
        last, _round = _round, None
        last.close()


def wait(timeout_s: float = WAIT_S) -> None:
    """In a worker forked under ``forking``: return once the last worker of its round is forked. Elsewhere at once."""
    global _inherited
    fd, _inherited = _inherited, None
    if fd is None:
        return
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                log.warning("the launcher had not forked this worker's siblings after %.0f s; going on", timeout_s)
                return
            if not os.read(fd, 1):  # the launcher closed its end: every worker of the round is forked
                return
    finally:
        os.close(fd)
