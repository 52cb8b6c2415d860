"""CURVE keys and roles: who may talk to a coordinator, and as what.

ZeroMQ's CURVE mechanism encrypts every connection and proves each side's
key; a ZAP authenticator (``zmq.auth``) decides which client keys are let in.
This module owns the key files and the roles (SPEC.md section 11, "Auth"):

* ``diloco keygen NAME --out DIR`` writes ``DIR/NAME.key`` (the public key,
  to hand out) and ``DIR/NAME.key_secret`` (mode 0600, to keep).
* a server's auth directory holds ``server.key_secret`` (its own key pair),
  ``workers/*.key`` (public keys allowed to train) and ``admins/*.key``
  (public keys allowed to run admin commands). A worker key may hold one
  worker id at a time; ``workers/NAME.max_ids`` (a number) allows key NAME
  that many at once (a host that runs several workers under one key).

Two pitfalls of pyzmq's machinery are closed here, each with a test: a CURVE
server without an authenticator on its *own* context accepts every client
key (so ``ServerAuth.start`` starts one on the context the ROUTER uses), and
``zmq.auth.create_certificates`` writes the secret file world-readable (so
``generate_keypair`` creates it under umask 077, and every secret file read
here must not be readable by group or others, as ssh insists).

Nothing here knows what a round or a worker is: a key has a name (its file
name) and a role.
"""

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

#: Environment variables a launcher can set instead of ``--key`` / ``--server-key``.
ENV_KEY = "DILOCO_KEY"
ENV_SERVER_KEY = "DILOCO_SERVER_KEY"

SERVER_KEY_NAME = "server"
#: The ZAP domain of a coordinator's socket; the authenticator answers for this domain only.
ZAP_DOMAIN = "diloco"
WORKERS_DIR = "workers"
ADMINS_DIR = "admins"


class AuthError(Exception):
    """A key file or auth directory that cannot be used; the message says which file and why."""


class Role(str, enum.Enum):
    """What an authenticated key may do."""

    #: Join, heartbeat, submit, leave; and ``status``.
    WORKER = "worker"
    #: Every admin command (``status``, ``shutdown``, ``set_min_workers``, ``kick``, ``unban``).
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class KeyIdentity:
    """An authenticated client: its public key (z85 text), the key file's name and its role."""

    public_key: str
    name: str
    role: Role
    #: Worker ids this key may hold at once (``workers/NAME.max_ids``; 1 by default).
    max_ids: int = 1

    def describe(self) -> str:
        return f"{self.role.value} key {self.name!r}"


# ------------------------------------------------------------------ key files

def generate_keypair(name: str, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``out_dir/name.key`` and ``out_dir/name.key_secret`` (0600); refuse to overwrite either."""
    if not name or any(c in name for c in "/\\") or name.startswith("."):
        raise AuthError(f"key name {name!r}: expected a plain file name (letters, digits, '-', '_')")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise AuthError(f"{path} already exists: remove it first (a key is never overwritten)")
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even for a moment
    try:
        zmq.auth.create_certificates(str(out), name)
    finally:
        os.umask(old_umask)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)  # a public key is meant to be copied around
    return public, secret


def too_open(path: Path, what: str) -> str | None:
    """Why ``path`` must not hold a secret (group or others may read it, as ssh refuses), or None."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (f"{path}: permissions {stat.S_IMODE(mode):04o} are too open: {what} must be readable by its "
                f"owner only (chmod 600 {path})")
    return None


def load_secret_key(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file; refuse a file group or others can read."""
    p = Path(path)
    if not p.is_file():
        raise AuthError(f"{p}: no such key file")
    problem = too_open(p, "a secret key")
    if problem:
        raise AuthError(problem)
    public, secret = _read_key_file(p)
    if secret is None:
        raise AuthError(f"{p}: holds no secret key (is it the public .key file? pass NAME.key_secret)")
    return public, secret


def load_public_key(path: str | os.PathLike) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise AuthError(f"{p}: no such key file")
    public, _ = _read_key_file(p)
    return public


def _read_key_file(p: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(p))
    except (OSError, ValueError) as exc:
        raise AuthError(f"{p}: not a ZeroMQ key file ({exc})") from None
    for what, key in (("public", public), ("secret", secret)):
        if key is not None and len(key) != 40:
            raise AuthError(f"{p}: the {what} key is {len(key)} characters; a CURVE key is 40 (z85)")
    return public, secret


# ------------------------------------------------------------------ server side

#: The most ids one worker key may be allowed (``max_ids``): the core's default ``max_workers``.
MAX_IDS_PER_KEY = 10_000


def _max_ids(path: Path) -> int:
    """A worker key's allowance from ``workers/NAME.max_ids`` (1 when there is no such file)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 1
    except OSError as exc:
        raise AuthError(f"{path}: cannot be read: {exc}") from None
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    values = [ln for ln in lines if ln]
    try:
        (value,) = values
        n = int(value)
    except ValueError:
        raise AuthError(f"{path}: expected one whole number (the worker ids this key may hold at once), "
                        f"got {text.strip()[:60]!r}") from None
    if not 1 <= n <= MAX_IDS_PER_KEY:
        raise AuthError(f"{path}: {n} is not between 1 and {MAX_IDS_PER_KEY}")
    return n


@dataclass(frozen=True)
class ServerAuth:
    """A server's key pair and the public keys of each role, loaded from an auth directory."""

    directory: Path
    public_key: bytes
    secret_key: bytes
    #: z85 public key (text) -> identity.
    clients: dict[str, KeyIdentity]

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ServerAuth":
        d = Path(directory)
        if not d.is_dir():
            raise AuthError(f"--auth {d}: no such directory (expected {SERVER_KEY_NAME}.key_secret, "
                            f"{WORKERS_DIR}/*.key, {ADMINS_DIR}/*.key; `diloco keygen --help` shows the set-up)")
        public, secret = load_secret_key(d / f"{SERVER_KEY_NAME}.key_secret")
        clients: dict[str, KeyIdentity] = {}
        for role, sub in ((Role.WORKER, WORKERS_DIR), (Role.ADMIN, ADMINS_DIR)):
            folder = d / sub
            if not folder.is_dir():
                continue
            for key_file in sorted(folder.glob("*.key")):
                pk = load_public_key(key_file).decode("ascii")
                if pk == public.decode("ascii"):
                    raise AuthError(f"{key_file}: this is the server's own key; give clients their own keys")
                other = clients.get(pk)
                if other is not None:
                    raise AuthError(f"{key_file}: the same key is also {other.describe()}; one key, one role "
                                    f"(an admin key that also trains is two keys)")
                max_ids = _max_ids(folder / f"{key_file.stem}.max_ids") if role is Role.WORKER else 1
                clients[pk] = KeyIdentity(pk, key_file.stem, role, max_ids)
        if not clients:
            raise AuthError(f"--auth {d}: no client keys in {d / WORKERS_DIR} or {d / ADMINS_DIR}: nobody could "
                            f"connect")
        return cls(d, public, secret, clients)

    def identity(self, user_id: str | None) -> KeyIdentity | None:
        """The identity of a ZAP User-Id (the z85 public key), or None if unknown."""
        return self.clients.get(user_id) if user_id else None

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server with this key pair (before bind)."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode("ascii")

    def start_authenticator(self, ctx: zmq.Context):
        """A ZAP authenticator on ``ctx`` that lets in exactly this directory's client keys.

        It must run on the same context as the server socket: a CURVE server
        whose context has no authenticator lets every key in.
        """
        from zmq.auth.thread import ThreadAuthenticator

        allowed = frozenset(self.clients)

        class _Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return key.decode("ascii") in allowed

        auth = ThreadAuthenticator(ctx, log=_quiet_logger())
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_Keys())
        return auth


def _quiet_logger():
    import logging

    return logging.getLogger("diloco.transport.zmq.auth")


# ------------------------------------------------------------------ client side

@dataclass(frozen=True)
class ClientAuth:
    """A client's key pair and the server's public key."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes
    key_file: str

    @classmethod
    def load(cls, key_file: str | os.PathLike, server_key_file: str | os.PathLike) -> "ClientAuth":
        public, secret = load_secret_key(key_file)
        return cls(public, secret, load_public_key(server_key_file), str(key_file))

    @classmethod
    def from_options(cls, key: str | None, server_key: str | None, environ=os.environ) -> "ClientAuth | None":
        """``--key``/``--server-key`` or ``DILOCO_KEY``/``DILOCO_SERVER_KEY``; None when neither is set."""
        key = key or environ.get(ENV_KEY) or None
        server_key = server_key or environ.get(ENV_SERVER_KEY) or None
        if key is None and server_key is None:
            return None
        if key is None or server_key is None:
            missing = "--key (or DILOCO_KEY)" if key is None else "--server-key (or DILOCO_SERVER_KEY)"
            raise AuthError(f"{missing} is missing: an authenticated connection needs both this client's "
                            f"secret key file and the server's public key file")
        return cls.load(key, server_key)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client (before connect)."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_serverkey = self.server_key


__all__ = [
    "AuthError", "ClientAuth", "KeyIdentity", "Role", "ServerAuth", "ENV_KEY", "ENV_SERVER_KEY",
    "generate_keypair", "load_public_key", "load_secret_key",
]
