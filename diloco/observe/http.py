"""The dashboard, ``/api/status`` and ``/metrics`` over HTTP: a WSGI app on the standard library's server.

``diloco server --http HOST:PORT`` serves, read-only:

* ``/``: the live dashboard (``dashboard.html``, shipped in the package;
  inline CSS, JS and SVG, nothing fetched from elsewhere), which polls
* ``/api/status``: the ``Observatory``'s last snapshot as JSON;
* ``/metrics``: Prometheus text from ``prometheus_client.make_wsgi_app``.

The server is ``wsgiref``'s (no HTTP parsing of ours), one request at a time
on one daemon thread, each connection's socket timing out after
``REQUEST_TIMEOUT_S``: a slow or stuck client costs at most that, never the
coordinator's loop, which only publishes snapshots. ``close()`` stops it.

With a ``token`` (``diloco server --auth DIR``: ``token.py``) every path
answers 401 unless the request carries it; ``/?token=TOKEN`` sets it as a
cookie and redirects to the same path without it, so it leaves the address
bar and the page's polling carries it.
"""

from __future__ import annotations

import json
import socket
import threading
from importlib import resources
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from diloco.observe.prom import make_registry
from diloco.observe.token import presented_token, set_cookie_header, token_matches

#: Seconds a client may take to send its request or read the answer.
REQUEST_TIMEOUT_S = 5.0


def dashboard_html() -> bytes:
    return resources.files("diloco.observe").joinpath("dashboard.html").read_bytes()


def make_app(observatory, token: str | None = None) -> Callable:
    """The WSGI app: ``/``, ``/api/status``, ``/metrics``; GET and HEAD only; with ``token``, only for it."""
    metrics_app = make_wsgi_app(make_registry(observatory))
    page = dashboard_html()

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            return _reply(start_response, "405 Method Not Allowed", b"read-only: GET or HEAD\n", "text/plain",
                          [("Allow", "GET, HEAD")])
        if token is not None:
            presented, in_query = presented_token(environ)
            if not token_matches(presented, token):
                return _reply(start_response, "401 Unauthorized", UNAUTHORIZED, "text/plain",
                              [("WWW-Authenticate", 'Bearer realm="diloco"')])
            if in_query:
                return _reply(start_response, "303 See Other", b"", "text/plain",
                              [("Location", path), set_cookie_header(token)])
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/api/status":
            body = json.dumps(observatory.snapshot(), default=str, separators=(",", ":")).encode()
            return _reply(start_response, "200 OK", body, "application/json")
        if path in ("/", "/index.html"):
            return _reply(start_response, "200 OK", page, "text/html; charset=utf-8")
        return _reply(start_response, "404 Not Found", b"not found: try /, /api/status or /metrics\n", "text/plain")

    return app


UNAUTHORIZED = (b"401: this dashboard needs its token (the file http.token in the server's --auth directory): "
                b"send 'Authorization: Bearer TOKEN', or open /?token=TOKEN once in a browser\n")


def _reply(start_response: Callable, status: str, body: bytes, ctype: str, extra=()) -> list[bytes]:
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"), *extra])
    return [body]


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # StreamRequestHandler sets it on the connection's socket

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        pass  # the server's stdout is for the run's events


class _WSGIServer6(WSGIServer):
    address_family = socket.AF_INET6


class DashboardServer:
    """``make_app`` on ``host:port`` (port 0: a free one; ``address`` says which), on a daemon thread."""

    def __init__(self, observatory, host: str, port: int, token: str | None = None) -> None:
        server_class = _WSGIServer6 if ":" in host else WSGIServer
        self._server: WSGIServer = make_server(host, port, make_app(observatory, token), server_class=server_class,
                                               handler_class=_QuietHandler)
        self._server.timeout = REQUEST_TIMEOUT_S
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="diloco-http", daemon=True)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "DashboardServer":
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout_s)
        self._server.server_close()


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ``ValueError`` saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r}: expected HOST:PORT, e.g. 127.0.0.1:8080 (port 0 picks a free one)")
    host = host.strip("[]")
    try:
        n = int(port)
    except ValueError:
        raise ValueError(f"{text!r}: port {port!r} is not a number") from None
    if not 0 <= n <= 65535:
        raise ValueError(f"{text!r}: port {n} is outside 0-65535")
    return host, n
