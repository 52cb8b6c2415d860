"""Authentication and roles (SPEC.md section 11, "Auth"): CURVE keys, worker and admin roles, ids bound to keys.

Key files and the endpoint are tested in this process; the deployment tests
run a real ``diloco server --auth`` and real workers on 127.0.0.1, then
attack them from raw ZeroMQ sockets: with no key, with an unknown key, with
a worker key doing an admin's job, with another worker's id, and with
another worker's routing id.
"""

from __future__ import annotations

import os
import stat
import time

import pytest

from diloco.cli import EXIT_AUTH_REFUSED, EXIT_PROBLEM, main
from diloco.testing import join_message, params_of
from diloco.wire.messages import (
    AdminRequest,
    Error,
    ErrorCode,
    Heartbeat,
    Submit,
    spec_of,
)
from diloco.wire.zmq import AuthRefused, ZmqCoordinatorEndpoint, ZmqWorkerEndpoint
from diloco.transport.zmq.auth import AuthError, ClientAuth, Role, ServerAuth, generate_keypair, load_secret_key

# ------------------------------------------------------------------ key files


def test_keygen_writes_a_0600_secret_and_refuses_to_overwrite(tmp_path):
    public, secret = generate_keypair("w1", tmp_path)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pk, sk = load_secret_key(secret)
    assert len(pk) == 40 and len(sk) == 40
    with pytest.raises(AuthError, match="already exists"):
        generate_keypair("w1", tmp_path)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_secret_key_readable_by_others_is_refused_as_ssh_does(tmp_path, mode):
    _, secret = generate_keypair("w1", tmp_path)
    os.chmod(secret, mode)
    with pytest.raises(AuthError, match=f"permissions {mode:04o} are too open"):
        load_secret_key(secret)


def test_the_keygen_command_and_a_public_file_passed_as_a_secret(tmp_path, capsys):
    assert main(["keygen", "ops", "--out", str(tmp_path / "k")]) == 0
    assert "ops.key_secret" in capsys.readouterr().out
    assert main(["keygen", "ops", "--out", str(tmp_path / "k")]) == 2  # never overwrites
    with pytest.raises(AuthError, match="holds no secret key"):
        os.chmod(tmp_path / "k" / "ops.key", 0o600)
        load_secret_key(tmp_path / "k" / "ops.key")


def _auth_dir(tmp_path, workers=("w1",), admins=("ops",)):
    d = tmp_path / "auth"
    generate_keypair("server", d)
    keys = {}
    for names, sub in ((workers, "workers"), (admins, "admins")):
        (d / sub).mkdir(exist_ok=True)
        for n in names:
            keys[n] = generate_keypair(n, tmp_path / "keys")
            (d / sub / f"{n}.key").write_bytes(keys[n][0].read_bytes())
    return d, keys


def test_server_auth_loads_roles_and_refuses_a_key_in_both_roles(tmp_path):
    d, keys = _auth_dir(tmp_path)
    auth = ServerAuth.load(d)
    assert sorted((i.name, i.role) for i in auth.clients.values()) == [("ops", Role.ADMIN), ("w1", Role.WORKER)]
    (d / "admins" / "w1.key").write_bytes(keys["w1"][0].read_bytes())
    with pytest.raises(AuthError, match="one key, one role"):
        ServerAuth.load(d)


def test_client_options_need_both_files(tmp_path):
    d, keys = _auth_dir(tmp_path)
    assert ClientAuth.from_options(None, None, environ={}) is None
    with pytest.raises(AuthError, match="--server-key"):
        ClientAuth.from_options(str(keys["w1"][1]), None, environ={})
    env = {"DILOCO_KEY": str(keys["w1"][1]), "DILOCO_SERVER_KEY": str(d / "server.key")}
    assert ClientAuth.from_options(None, None, environ=env).public_key == load_secret_key(keys["w1"][1])[0]


# ------------------------------------------------------------------ the endpoint


def _recv_until(ep, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        item = ep.recv(0.05)
        if item is not None:
            return item
    return None


def test_the_endpoint_lets_in_only_the_directory_keys_with_their_identity(tmp_path):
    """A CURVE server without an authenticator on its own context lets every key in: ours must not."""
    d, keys = _auth_dir(tmp_path)
    stranger = generate_keypair("stranger", tmp_path / "other")
    server = ZmqCoordinatorEndpoint("tcp://127.0.0.1:0", auth=ServerAuth.load(d))
    try:
        bad = ZmqWorkerEndpoint(server.address, auth=ClientAuth.load(stranger[1], d / "server.key"))
        plain = ZmqWorkerEndpoint(server.address)
        good = ZmqWorkerEndpoint(server.address, auth=ClientAuth.load(keys["w1"][1], d / "server.key"))
        try:
            for ep in (bad, plain):
                try:
                    ep.send(Heartbeat("w1"))
                except AuthRefused:
                    pass  # the handshake may already have failed: then the send itself says so
            good.send(Heartbeat("w1"))
            peer, msg, identity, *_ = _recv_until(server, 10)
            assert msg == Heartbeat("w1") and peer == good.peer
            assert (identity.name, identity.role) == ("w1", Role.WORKER)
            assert _recv_until(server, 1.0) is None  # the stranger's and the plaintext heartbeats never arrive
            with pytest.raises(AuthRefused, match="refused this key"):
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    bad.recv(0.1)
            # A plaintext client is kept out either way; what it is told depends on a race in libzmq's
            # handshake: it names the mechanism mismatch (then the error says what to do) when the
            # server's greeting reaches it before the server closes the connection, else it sees the
            # connection close, like a network fault, and retries.
            try:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    plain.recv(0.1)
            except AuthRefused as exc:
                assert "requires authentication" in str(exc)
            else:
                assert plain.counters["handshake_failures"] >= 3 and not plain.counters["handshakes"]
            assert server.stats()["auth_failures"] >= 1
        finally:
            for ep in (bad, plain, good):
                ep.close()
    finally:
        server.close()


def test_roles_are_checked_before_the_coordinator_sees_a_message(tmp_path):
    d, keys = _auth_dir(tmp_path)
    server = ZmqCoordinatorEndpoint("tcp://127.0.0.1:0", auth=ServerAuth.load(d))
    worker = ZmqWorkerEndpoint(server.address, auth=ClientAuth.load(keys["w1"][1], d / "server.key"))
    admin = ZmqWorkerEndpoint(server.address, auth=ClientAuth.load(keys["ops"][1], d / "server.key"))
    try:
        worker.send(AdminRequest("shutdown", {"kind": "abort"}))
        admin.send(Heartbeat("ops"))
        worker.send(AdminRequest("status"))
        peer, msg, identity, *_ = _recv_until(server, 10)
        assert msg == AdminRequest("status") and identity.role is Role.WORKER  # status: either role
        assert _recv_until(server, 0.5) is None
        replies = [_recv_until(worker, 5), _recv_until(admin, 5)]
        assert [(r.code, r.in_reply_to) for r in replies] == [(ErrorCode.FORBIDDEN, "AdminRequest"),
                                                              (ErrorCode.FORBIDDEN, "Heartbeat")]
        assert "needs an admin key" in replies[0].detail and "needs a worker key" in replies[1].detail
        assert server.stats()["forbidden"] == 2
    finally:
        for ep in (worker, admin, server):
            ep.close()


# ------------------------------------------------------------------ a real deployment



def _tiny_spec():
    from procs import ENTRY  # noqa: F401  (tests/zmq on sys.path)
    from tiny_entry import make_setup

    params = params_of(make_setup("probe").model)
    return params, spec_of(params)


class RawClient:
    """A bare ZeroMQ DEALER speaking the codec, optionally as a CURVE client, with a chosen routing id."""

    def __init__(self, address: str, auth: ClientAuth | None = None, routing_id: bytes | None = None) -> None:
        self.ep = ZmqWorkerEndpoint(address, auth=auth, routing_id=routing_id, label="raw")

    def ask(self, message, timeout_s: float = 3.0):
        self.ep.send(message)
        return _recv_until(self.ep, timeout_s)

    def close(self) -> None:
        self.ep.close()


@pytest.mark.slow
def test_only_keys_in_their_roles_can_act_and_ids_stay_with_their_keys(cluster, capsys):
    cluster.make_keys(workers=("k1", "k2", "k3"), admins=("ops",), others=("rogue",))
    server = cluster.server("--min-workers", "2", "--auth", str(cluster.auth_dir), heartbeat_timeout_s=5.0)
    w1 = cluster.worker("w1", *cluster.key_args("k1"))
    cluster.worker("w2", *cluster.key_args("k2"))
    start = cluster.wait_status(lambda s: s["rounds_applied"] >= 2, 120, "rounds applied")
    addr = cluster.address
    params, spec = _tiny_spec()

    # No key at all: the handshake fails; nothing reaches the coordinator, and the client is told why.
    rc = main(["shutdown", "--abort", "--connect", addr, "--timeout", "5"])
    assert rc == EXIT_AUTH_REFUSED and "requires authentication" in capsys.readouterr().err
    # A key the server does not know: refused, with its own line and exit code (not a timeout).
    rc = main(["set-min-workers", "1", "--connect", addr, "--timeout", "5", *cluster.key_args("rogue")])
    assert rc == EXIT_AUTH_REFUSED and "refused this key" in capsys.readouterr().err
    rogue = RawClient(addr, ClientAuth.load(cluster.keys["rogue"][1], cluster.server_key))
    with pytest.raises(AuthRefused):
        for _ in range(50):
            rogue.ask(join_message("w9", params), 0.2)
    rogue.close()

    # A worker key runs no admin command but status.
    for args in (["shutdown", "--abort"], ["set-min-workers", "1"], ["kick", "w1"]):
        rc = main([*args, "--connect", addr, "--timeout", "5", *cluster.key_args("k2")])
        assert rc == EXIT_PROBLEM and "forbidden" in capsys.readouterr().err, args
    assert main(["status", "--json", "--connect", addr, *cluster.key_args("k2")]) == 0
    capsys.readouterr()

    # Another worker key cannot speak for w1: join, submit, heartbeat are all wrong_key.
    k3 = RawClient(addr, ClientAuth.load(cluster.keys["k3"][1], cluster.server_key))
    try:
        for message in (join_message("w1", spec), Heartbeat("w1"),
                        Submit("w1", 0, start["fragments"][0]["round_id"], {})):
            reply = k3.ask(message)
            assert isinstance(reply, Error) and reply.code is ErrorCode.WRONG_KEY, (message, reply)
            assert "'k1'" in reply.detail and "'k3'" in reply.detail
    finally:
        k3.close()

    # Another key on w1's own routing id: without ROUTER_HANDOVER libzmq refuses the second
    # connection, so the socket cannot take w1's place (and would be wrong_key if it could).
    rid = w1.wait_for(r"routing id (\S+)\)").group(1).encode("ascii")
    thief = RawClient(addr, ClientAuth.load(cluster.keys["k3"][1], cluster.server_key), routing_id=rid)
    try:
        reply = thief.ask(Heartbeat("w1"), 3.0)
        assert reply is None or (isinstance(reply, Error) and reply.code is ErrorCode.WRONG_KEY), reply
    finally:
        thief.close()

    # The run never noticed: the same members, every round from both of them, and it goes on.
    st = cluster.wait_status(lambda s: s["rounds_applied"] >= start["rounds_applied"] + 3, 60, "more rounds")
    assert cluster.members(st) == {"w1", "w2"}
    assert st["phase"] == "running" and st["min_workers"] == 2
    assert "left" not in server.output() and "dead" not in server.output()
    assert st["transport"]["forbidden"] >= 3 and st["transport"]["auth_failures"] >= 2


@pytest.mark.slow
def test_kick_ban_keeps_a_worker_and_its_key_out_until_unban(cluster, capsys):
    cluster.make_keys(workers=("k1", "k2"), admins=("ops",))
    cluster.server("--min-workers", "1", "--auth", str(cluster.auth_dir), heartbeat_timeout_s=5.0)
    cluster.worker("w1", *cluster.key_args("k1"))
    w2 = cluster.worker("w2", *cluster.key_args("k2"))
    cluster.wait_status(lambda s: len(s["members"]) == 2, 120, "two members")
    admin = ["--connect", cluster.address, "--timeout", "5", *cluster.key_args("ops")]
    assert main(["kick", "w2", "--ban", *admin]) == 0
    # w2 is answered rejoin, and its join is refused: it exits 1 naming the ban.
    assert w2.wait_exit(60) == 1
    assert "banned" in w2.output()
    st = cluster.status()
    assert st["banned_workers"] == ["w2"] and st["banned_keys"] == ["k2"]
    assert cluster.members(st) == {"w1"}
    # The key is banned too: the same key under a new id is refused.
    again = cluster.worker("w2b", *cluster.key_args("k2"))
    assert again.wait_exit(60) == 1 and "key 'k2' is banned" in again.output()
    capsys.readouterr()
    assert main(["unban", "w2", *admin]) == 0
    assert main(["unban", "w2", *admin]) == EXIT_PROBLEM  # not banned any more
    cluster.worker("w2", *cluster.key_args("k2"))
    st = cluster.wait_status(lambda s: {"w1", "w2"} <= {m["worker_id"] for m in s["members"]}, 120, "w2 back")
    assert st["banned_workers"] == [] and st["banned_keys"] == []


@pytest.mark.parametrize("bind, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.4.5:0", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/diloco.sock", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.0.0.5:5555", False),
    ("tcp://eth0:5555", False), ("tcp://[::]:5555", False), ("tcp://example.org:5555", False),
])
def test_which_binds_count_as_loopback(bind, loopback):
    from diloco.deploy.commands import _is_loopback_bind

    assert _is_loopback_bind(bind) is loopback


def test_a_server_refuses_to_listen_beyond_loopback_without_auth(capsys):
    """A5: nothing is started; the refusal names both ways out."""
    assert main(["server", "--bind", "tcp://0.0.0.0:0"]) == 2
    err = capsys.readouterr().err
    assert "needs --auth DIR" in err and "--insecure" in err
