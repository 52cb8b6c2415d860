"""``diloco server --http HOST:PORT --log-dir DIR``: an ``Observatory`` on the coordinator, its HTTP server and log."""

from __future__ import annotations

import time
from typing import TextIO

from diloco.observe.metrics_log import MetricsLog
from diloco.observe.observatory import Observatory


class ObserveError(Exception):
    """The dashboard or the metrics log cannot start (an unusable address or directory)."""


class Observing:
    """A run's observatory and what it feeds; ``close()`` stops the HTTP server and closes the log."""

    def __init__(self, observatory: Observatory, http, log: MetricsLog | None) -> None:
        self.observatory, self.http, self.log = observatory, http, log

    def close(self) -> None:
        try:
            if self.http is not None:
                self.observatory.publish(time.monotonic())  # the page shows how the run ended
                self.http.close()
        finally:
            if self.log is not None:
                self.log.close()


def start_observing(coordinator, tee, *, version: str, http: str | None, log_dir: str | None,
                    out: TextIO, auth_dir: str | None = None) -> Observing:
    """Attach an ``Observatory`` to ``coordinator`` (through the server's observer ``tee``) and start
    the HTTP server (``http``: HOST:PORT; with ``auth_dir``, only for the token in it, ``token.py``)
    and/or the metrics log (``log_dir``); prints where they are."""
    token = token_file = None
    if http is not None and auth_dir is not None:
        from diloco.observe.token import TokenError, load_or_create_token

        try:
            token, token_file, created = load_or_create_token(auth_dir)
        except (TokenError, OSError) as exc:
            raise ObserveError(f"--http {http}: {exc}") from None
        if created:
            print(f"  dashboard token created: {token_file} (mode 0600)", file=out, flush=True)
    log = None
    if log_dir is not None:
        try:
            log = MetricsLog(log_dir)
        except OSError as exc:
            raise ObserveError(f"--log-dir {log_dir}: cannot open the metrics log: {exc}") from None
    observatory = Observatory(coordinator, version=version, log=log)
    server = None
    if http is not None:
        from diloco.observe.http import DashboardServer, parse_host_port

        try:
            host, port = parse_host_port(http)
            server = DashboardServer(observatory, host, port, token)
        except (ValueError, OSError) as exc:
            if log is not None:
                log.close()
            raise ObserveError(f"--http {http}: {exc}") from None
        observatory.http_address = server.address
    tee.observers.append(observatory)
    if log is not None:
        log.write("start", 0.0, run_id=coordinator.run_id, version=version, incarnation=coordinator.incarnation,
                  config=coordinator.config.to_dict(), rounds_applied=coordinator.fsm.rounds_applied)
        print(f"  metrics log {log.path} (a line per applied round and per worker sample; rotated past "
              f"{log.max_bytes >> 20} MiB, {log.backups} old files kept)", file=out, flush=True)
    observatory.publish(time.monotonic())
    if server is not None:
        server.start()
        access = ("no authentication" if token is None else
                  f"for the token in {token_file}: open /?token=TOKEN once, or send 'Authorization: Bearer TOKEN'")
        print(f"  dashboard {server.address}/ (read-only, {access}): the live page at /, JSON at "
              f"/api/status, Prometheus at /metrics", file=out, flush=True)
    return Observing(observatory, server, log)
