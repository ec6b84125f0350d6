"""A client of a torch ``TCPStore`` (the elastic agent's, or rank 0's) whose connection cannot hang.

torch bounds the TCP connect by the store's ``timeout``, but not the handshake that follows: ``TCPStore::ping`` waits
in ``recv`` with no timeout at all: a server that accepted the connection and never answered would leave a worker there
for good, its peers waiting for its address with it. Each connection here is made on a thread of its own, given
``HANDSHAKE_S`` to answer, and made again until ``timeout``, then ``StoreUnreachableError``; the constructor releases
the GIL while it waits, so a connection left unanswered keeps only its daemon thread. (The hang once blamed on an
unanswered handshake, one worker of four in the constructor, was a forked worker's resolver lock: ``fork_gate``.)
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

HANDSHAKE_S = 30.0  # ample for a handshake of milliseconds on a loaded machine; a lost one costs this much


class StoreUnreachableError(RuntimeError):
    """No store at ``host:port`` answered within the timeout."""


def wait_until_listening(host: str, port: int, deadline: float, poll_s: float = 0.1) -> None:
    """Knock with a plain socket until something listens at ``host:port`` (torch's own connect retries log a C++ error
    with frames at every try); ``StoreUnreachableError`` at ``deadline`` (``time.monotonic()``)."""
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise StoreUnreachableError(f"nothing listens at {host}:{port} ({exc})") from None
            time.sleep(poll_s)


def connect(host: str, port: int, timeout: datetime.timedelta, handshake_s: float = HANDSHAKE_S,
            **store_kwargs: Any) -> dist.TCPStore:
    """A ``TCPStore`` client of ``host:port`` (``store_kwargs`` go to the constructor), its operations' timeout
    ``timeout``. Raises ``StoreUnreachableError`` when nothing listened, or no connection was answered, by then; what
    the constructor raised otherwise."""
    deadline = time.monotonic() + timeout.total_seconds()
    tries = 0
    while True:
        wait_until_listening(host, port, deadline)  # so that a constructor still busy after handshake_s is unanswered
        tries += 1
        made: dict[str, Any] = {}

        def attempt() -> None:
            try:
                left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0))
                made["store"] = dist.TCPStore(host, port, is_master=False, timeout=left, **store_kwargs)
            except Exception as exc:  # noqa: BLE001 (raised below, in the caller's thread)
                made["error"] = exc

        thread = threading.Thread(target=attempt, name=f"store-connect-{host}:{port}", daemon=True)
        thread.start()
        thread.join(max(min(handshake_s, deadline - time.monotonic()), 0.1))
        if "error" in made:
            raise made["error"]
        if "store" in made:
            made["store"].set_timeout(timeout)
            return made["store"]
        if time.monotonic() >= deadline:
            raise StoreUnreachableError(f"the store at {host}:{port} answered none of {tries} connections within "
                                        f"{timeout.total_seconds():g} s")
        log.warning("the store at %s:%s did not answer a connection in %.0f s; connecting again", host, port,
                    handshake_s)
