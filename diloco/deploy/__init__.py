"""Running diloco as processes over ZeroMQ: the server, the worker process, the admin client.

``commands`` registers the CLI (``diloco server | worker | status | shutdown |
set-min-workers | kick``); ``server`` runs the coordinator on a ROUTER;
``worker_main`` runs a worker from a training setup (``default_entry`` is the
built-in demo); ``admin`` is the operator's client. docs/deployment.md walks
through a whole run on one machine.
"""
