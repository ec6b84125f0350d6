"""A store connection that no server answers ends, and one that a server lost is made again (store_client): torch's
``TCPStore`` client waits for the handshake's answer with no timeout at all."""

from __future__ import annotations

import datetime
import logging
import socket
import threading

import pytest
import torch.distributed as dist

from hydraddp.distributed import store_client


def _listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    return server


class _LosingProxy:
    """Listens on a port of its own; the first ``lose`` connections it accepts and never answers (a server that lost
    them), every later one it pipes to ``target_port``."""

    def __init__(self, target_port: int, lose: int):
        self.server, self.target_port, self.lose, self.held = _listener(), target_port, lose, []
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.server.accept()
            if len(self.held) < self.lose:
                self.held.append(conn)
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()


def test_a_connection_never_answered_ends_at_the_timeout_naming_the_store():
    server = _listener()  # accepts (the kernel's backlog) and never answers: torch alone would wait for good
    port = server.getsockname()[1]
    with pytest.raises(store_client.StoreUnreachableError, match=rf"127\.0\.0\.1:{port} answered none of [2-9]"):
        store_client.connect("127.0.0.1", port, datetime.timedelta(seconds=3), handshake_s=1.0)


def test_a_lost_connection_is_made_again_and_the_store_works(caplog):
    real = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    proxy = _LosingProxy(real.port, lose=2)  # the knock before the first try, and the first try itself
    with caplog.at_level(logging.WARNING, logger=store_client.__name__):
        store = store_client.connect("127.0.0.1", proxy.port, datetime.timedelta(seconds=60), handshake_s=1.0)
    store.set("key", "value")
    assert real.get("key") == b"value"
    assert store.timeout == datetime.timedelta(seconds=60)  # the operations' timeout is the caller's, not a try's
    assert f"the store at 127.0.0.1:{proxy.port} did not answer a connection in 1 s; connecting again" in caplog.text


def test_nothing_listening_ends_at_the_timeout():
    server = _listener()
    port = server.getsockname()[1]
    server.close()
    with pytest.raises(store_client.StoreUnreachableError, match=rf"nothing listens at 127\.0\.0\.1:{port}"):
        store_client.connect("127.0.0.1", port, datetime.timedelta(seconds=1))
