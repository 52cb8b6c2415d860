"""Watching a run: the coordinator's figures for operators (SPEC.md section 12, "What the coordinator reports").

``observatory``: gathers them on the coordinator's thread and publishes
snapshots; ``prom``: Prometheus series; ``http``: the dashboard, ``/api/status``
and ``/metrics`` on a WSGI server thread; ``metrics_log``: the JSONL metrics
log; ``plotlog``: a PNG of a log. Nothing here feeds back into the run.
Importing this package loads nothing heavy (the modules import on use).
"""
