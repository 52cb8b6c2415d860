"""What several commands share: the server's wire-dtype default and the client keys' flags to ``ClientAuth``.

Its own module so that ``server.py`` and ``worker_main.py`` need not import
``commands.py`` (which imports them, lazily, to run them): no import circle.
Imports nothing heavy, so ``diloco --help`` stays fast.
"""

from __future__ import annotations

from diloco.exits import UsageError

#: ``diloco server --wire-dtype``: how pseudo-gradients and Results travel in a fresh run.
#: Chosen from benchmarks/bench_training.py --wire (benchmarks/README.md).
DEFAULT_WIRE_DTYPE = "int8"
#: ``diloco server --grace-window auto``: the longest window, where it starts (``--grace-window-max``).
DEFAULT_GRACE_CEILING_S = 5.0
#: ``diloco server --heal-sources``: members a joiner copies the state from at once (collective plane).
#: Two: on this project's recovery benchmark (2 cores, loopback, 100M params) two sources healed a
#: little faster than one and three slower (every source also in the rounds: benchmarks/README.md,
#: bench_recovery); over links where each source's upload is the limit, more pay.
DEFAULT_HEAL_SOURCES = 2
#: The ``--wire-dtype`` choices: ``diloco.wire.messages.WIRE_DTYPE_NAMES`` (a test checks they agree),
#: spelled out so that parsing the command line imports no torch.
WIRE_DTYPES = ("fp32", "bf16", "int8", "int4", "sparse")


def client_auth(args):
    """``--key``/``--server-key`` (or their environment variables) -> ``ClientAuth``, or None; ``UsageError`` if bad."""
    from diloco.transport.zmq.auth import AuthError, ClientAuth

    try:
        return ClientAuth.from_options(args.key, args.server_key)
    except AuthError as exc:
        raise UsageError(str(exc)) from None
