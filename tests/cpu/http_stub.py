"""A stand-in for a vLLM server's HTTP side, for tests of the eval clients.

:class:`StubServer` serves one handler class on a free local port from a daemon thread.
:class:`VllmStubHandler` answers ``/health`` and ``/v1/models`` (its ``listing``) as vLLM's
OpenAI server does, and 404 elsewhere; a test subclasses it for ``/v1/completions``
(``do_POST``) or ``/metrics`` (``extra_get``).
"""

from __future__ import annotations

import http.server
import json
import threading


def models_listing(model: str = "m", max_model_len: int = 1024) -> str:
    """The body of vLLM's ``/v1/models`` for one served model."""
    return json.dumps({"data": [{"id": model, "max_model_len": max_model_len}]})


class VllmStubHandler(http.server.BaseHTTPRequestHandler):
    listing: str = models_listing()

    def extra_get(self) -> bytes | None:
        """The body of a GET outside ``/health`` and ``/v1/models``; None: 404."""
        return None

    def do_GET(self) -> None:
        known = {"/health": b"", "/v1/models": self.listing.encode()}
        body = known[self.path] if self.path in known else self.extra_get()
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


class StubServer:
    """``handler`` served on 127.0.0.1 at a free port until :meth:`close`."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
