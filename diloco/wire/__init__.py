"""The wire format: what crosses between the coordinator and workers, and how.

``messages`` defines the messages (they carry round ids and reject reasons,
so they know the protocol; the transport below does not), ``codec`` turns a
message into frames and back (SPEC.md section 11), ``endpoints`` is the
interface the coordinator and the worker hold, and ``zmq`` implements it on
the ZeroMQ transport's frames.
"""
