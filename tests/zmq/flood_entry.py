"""A connection flood against a coordinator: ``python flood_entry.py ADDRESS [options]``.

Opens ``--connections`` DEALERs (raw pyzmq, optionally CURVE with one key), each of
which sends the first part of a two-part message ``--starts`` times (every start
leaves the one before it unfinished), keeps them open ``--hold`` seconds and then
closes them all at once. ``--ping-ms`` turns on libzmq's own ZMTP heartbeat on the
flood's sockets: with its timeout as short as the interval, a flood socket whose
connection the coordinator's libzmq had paused gives up on it and dials again, which
is how libzmq 4.3.5 was made to abort the coordinator every time (SPEC.md section 11,
"Limits"). Prints one line per phase; exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from diloco.transport.zmq.auth import ClientAuth  # noqa: E402
from diloco.transport.zmq.framing import tag  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--connections", type=int, default=1100)
    p.add_argument("--starts", type=int, default=1, help="first parts sent per connection")
    p.add_argument("--payload", type=int, default=100, help="bytes in each first part")
    p.add_argument("--hold", type=float, default=3.0)
    p.add_argument("--ping-ms", type=int, default=0)
    p.add_argument("--key")
    p.add_argument("--server-key")
    a = p.parse_args()
    auth = ClientAuth.load(a.key, a.server_key) if a.key else None
    ctx = zmq.Context()
    ctx.max_sockets = a.connections + 100
    payload = b"x" * a.payload
    socks = []
    t0 = time.monotonic()
    sent = 0
    for _ in range(a.connections):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.sndhwm = 0
        if a.ping_ms:
            s.heartbeat_ivl = a.ping_ms
        if auth is not None:
            auth.apply(s)
        s.connect(a.address)
        socks.append(s)
    for seq in range(1, a.starts + 1):
        for s in socks:
            s.send_multipart([tag(seq, 0, 2), payload], zmq.NOBLOCK)
            sent += 1
    print(f"flood: {len(socks)} connections, {sent} message starts queued in {time.monotonic() - t0:.1f} s",
          flush=True)
    time.sleep(a.hold)
    for s in socks:
        s.close(0)
    print(f"flood: all closed at {time.monotonic() - t0:.1f} s", flush=True)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
