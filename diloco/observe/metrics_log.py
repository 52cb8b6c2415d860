"""The JSONL metrics log (``diloco server --log-dir DIR``): ``DIR/metrics.jsonl``, size-bounded by rotation.

One JSON object per line: ``{"t": wall clock, "run_s": seconds since the
server started, "kind": ..., ...}``, where ``kind`` is

* ``start``: ``run_id``, ``version``, ``config``, ``incarnation``;
* ``sample``: one worker's heartbeat metrics (``worker_id``, ``step``,
  ``steps_per_s``, ``loss``, ``eval_loss``, ``samples``: those it sent);
* ``round``: an applied round (``fragment_id``, ``round_id``,
  ``contributors``, ``loss``: the mean of the contributors' latest losses,
  ``rounds_applied``);
* ``state``: a worker's state as the coordinator sees it changed
  (``worker_id``, ``state``: training, waiting, paused, dead, or null: no
  longer a member) -- the dashboard's membership timeline;
* ``event``: a membership or quorum event (``event``: join, left, dead,
  quorum, stop, ... with the coordinator observer's fields).

Rotation is the standard library's ``logging.handlers.RotatingFileHandler``:
past ``max_bytes`` the file becomes ``metrics.jsonl.1`` (older ones
``.2`` ... ``.<backups>``, the oldest deleted), so the log never holds more
than ``(backups + 1) * max_bytes``. ``read_log`` reads them back, oldest first.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import pathlib
import time
from typing import Any, Iterator

FILENAME = "metrics.jsonl"
DEFAULT_MAX_BYTES = 16 << 20
DEFAULT_BACKUPS = 4


class MetricsLog:
    """Appends lines to ``DIR/metrics.jsonl`` (rotating); ``write`` never raises on a full disk, it counts."""

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 backups: int = DEFAULT_BACKUPS) -> None:
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / FILENAME
        self.max_bytes, self.backups = max_bytes, backups
        self._handler = logging.handlers.RotatingFileHandler(self.path, maxBytes=max_bytes,
                                                             backupCount=backups, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        # A logger of its own: never propagated to the root logger (stderr), never shared.
        self._logger = logging.Logger(f"diloco.metrics_log.{id(self)}", logging.INFO)
        self._logger.propagate = False
        self._logger.addHandler(self._handler)
        self.lines = 0

    def write(self, kind: str, run_s: float, **fields: Any) -> None:
        line = {"t": round(time.time(), 3), "run_s": run_s, "kind": kind, **fields}
        self._logger.info(json.dumps(line, default=str, separators=(",", ":")))
        self.lines += 1

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()


def log_files(directory: str | os.PathLike) -> list[pathlib.Path]:
    """The log's files, oldest first (``metrics.jsonl.N`` ... ``metrics.jsonl.1``, ``metrics.jsonl``)."""
    d = pathlib.Path(directory)
    rotated = []
    for p in d.glob(FILENAME + ".*"):
        suffix = p.name[len(FILENAME) + 1:]
        if suffix.isdigit():
            rotated.append((int(suffix), p))
    files = [p for _, p in sorted(rotated, reverse=True)]
    if (d / FILENAME).exists():
        files.append(d / FILENAME)
    return files


def read_log(directory: str | os.PathLike) -> Iterator[dict]:
    """Every well-formed line of the log, oldest first (a torn or foreign line is skipped)."""
    for path in log_files(directory):
        with open(path, encoding="utf-8", errors="replace") as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and isinstance(line.get("kind"), str):
                    yield line
