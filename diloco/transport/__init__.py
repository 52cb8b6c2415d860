"""Moving messages between the coordinator and workers. Knows nothing about rounds.

``messages`` defines what crosses the wire; ``base`` the interface both
transports implement (``inproc`` for threads of one process, ``zmq`` for
processes and machines). The coordinator and the worker only ever see these.
"""
