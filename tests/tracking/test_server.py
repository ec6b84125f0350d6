"""The tracking preflight against a real HTTP server on this machine whose API answers slowly, as a PostgreSQL-backed
MLflow server's workers do on a busy node while each opens its database."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from hydraddp.tracking.server import preflight


@pytest.fixture
def slow_api_server():
    """A server whose /health answers at once and whose API answers after ``delay_s`` (settable)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        delay_s = 0.0

        def do_GET(self):  # noqa: N802 - http.server's name
            if not self.path.startswith("/health"):
                time.sleep(Handler.delay_s)
            body = b"OK" if self.path.startswith("/health") else b'{"experiments": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield Handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_api_slower_than_health_s_timeout_is_waited_for(slow_api_server):
    handler, uri = slow_api_server
    handler.delay_s = 1.0
    assert preflight(uri, timeout_s=0.3) is None


def test_an_api_that_does_not_answer_in_time_is_refused_naming_the_wait(slow_api_server):
    handler, uri = slow_api_server
    handler.delay_s = 3.0
    assert preflight(uri, timeout_s=0.3, api_timeout_s=0.5) == (
        f"the MLflow server at {uri} answers /health but not its API within 0.5 s (timed out)")
