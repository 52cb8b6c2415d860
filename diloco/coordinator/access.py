"""Who may speak for a worker id: key bindings and bans (SPEC.md section 11, "Auth").

With authentication on, the first authenticated key that joins a worker id is
bound to it: a message for that id under another key is refused (wrong_key).
``kick --ban`` keeps an id, and with authentication the key bound to it, out
at join until ``unban``. Both are part of the run, not of one coordinator
process: they are saved in every checkpoint (:meth:`AccessList.to_dict`) and
restored on ``--resume``, so a restart does not let a banned worker back in or
hand a bound id to another key. With a checkpoint directory a ban or unban is
itself written (a checkpoint of the same round) before ``kick --ban`` or
``unban`` is answered; a binding made since the newest checkpoint is made again
by the key that joins that id first after a restart.
"""

from __future__ import annotations

from typing import Callable

from diloco.wire.messages import ErrorCode, Join

#: Most worker-id-to-key bindings kept for ids that are no longer members (oldest forgotten first).
MAX_BOUND_IDS = 100_000


class AccessError(ValueError):
    """Saved access state that is not what :meth:`AccessList.to_dict` writes."""


class AccessList:
    def __init__(self) -> None:
        #: worker id -> public key of the authenticated key that first joined it.
        self.keys: dict[str, str] = {}
        #: public key -> its key file's name, for refusals and ``status``.
        self.key_names: dict[str, str] = {}
        #: ``kick --ban``: ids, and (with authentication) keys, refused at join until ``unban``.
        self.banned_ids: set[str] = set()
        self.banned_keys: set[str] = set()
        #: public key -> worker ids it may hold at once, as its identity said at its last join (``status``).
        self.allowances: dict[str, int] = {}
        #: Counts bans and unbans, so the runner writes a checkpoint before confirming one.
        self.ban_changes = 0

    def refusal(self, msg, identity, is_member: Callable[[str], bool] = lambda w: False) -> tuple[ErrorCode, str] | None:
        """Why a worker message is refused before anything else: a banned id or key, another key's id, or
        a join past the key's allowance of live ids."""
        wid = msg.worker_id
        if not isinstance(wid, str):
            return None  # the core rejects it with invalid_worker_id
        if isinstance(msg, Join):
            if wid in self.banned_ids:
                return ErrorCode.BANNED, f"worker {wid!r} is banned (kick --ban); `diloco unban {wid}` lets it back"
            if identity is not None and identity.public_key in self.banned_keys:
                return ErrorCode.BANNED, (f"key {identity.name!r} is banned (kick --ban); `diloco unban` with a "
                                          f"worker id it joined as lets it back")
        bound = self.keys.get(wid)
        if identity is not None and bound is not None and bound != identity.public_key:
            return ErrorCode.WRONG_KEY, (f"worker id {wid!r} is bound to key {self.key_names.get(bound, '?')!r}, "
                                         f"the key that first joined it; this message came with key "
                                         f"{identity.name!r}")
        if isinstance(msg, Join) and identity is not None and not is_member(wid):
            # One key, one live worker id (unless its allowance says more): a key cannot fill the
            # quorum, or weigh a round, as several workers (SPEC.md section 11, "Auth").
            allowed = getattr(identity, "max_ids", 1)
            held = self.live_ids(identity.public_key, is_member)
            if len(held) >= allowed:
                return ErrorCode.KEY_ID_LIMIT, (
                    f"key {identity.name!r} already holds {len(held)} live worker id(s) {held[:5]} and may hold "
                    f"{allowed} at once; a key that runs several workers needs workers/{identity.name}.max_ids "
                    f"in the server's auth directory")
        return None

    def live_ids(self, public_key: str, is_member: Callable[[str], bool]) -> list[str]:
        """The live members bound to ``public_key``."""
        return [w for w, k in self.keys.items() if k == public_key and is_member(w)]

    def key_summary(self, is_member: Callable[[str], bool]) -> list[dict]:
        """Per key with a live member: its name, live ids and allowance (``status``)."""
        out = []
        for pk, name in sorted(self.key_names.items(), key=lambda kv: kv[1]):
            ids = self.live_ids(pk, is_member)
            if ids:
                out.append({"key": name, "worker_ids": ids, "max_ids": self.allowances.get(pk, 1)})
        return out

    def bind(self, worker_id: str, identity, is_member: Callable[[str], bool]) -> None:
        self.allowances[identity.public_key] = getattr(identity, "max_ids", 1)
        if worker_id in self.keys:
            return
        self.keys[worker_id] = identity.public_key
        self.key_names[identity.public_key] = identity.name
        if len(self.keys) > MAX_BOUND_IDS:
            # Forget the oldest binding of an id that is no longer a member (a limit on what
            # grows); at most max_workers members stand before it, so this stays cheap per join.
            for wid in self.keys:
                if not is_member(wid):
                    del self.keys[wid]
                    break

    def ban(self, worker_id: str) -> None:
        self.ban_changes += 1
        self.banned_ids.add(worker_id)
        key = self.keys.get(worker_id)
        if key is not None:
            self.banned_keys.add(key)

    def unban(self, worker_id: str) -> bool:
        """Lift the ban of ``worker_id`` and its bound key; False if neither was banned."""
        key = self.keys.get(worker_id)
        found = worker_id in self.banned_ids or (key is not None and key in self.banned_keys)
        self.banned_ids.discard(worker_id)
        if key is not None:
            self.banned_keys.discard(key)
        self.ban_changes += found
        return found

    def banned_key_names(self) -> list[str]:
        return sorted(self.key_names.get(k, k) for k in self.banned_keys)

    # ------------------------------------------------------------ checkpoints

    def to_dict(self) -> dict:
        """Plain data for a checkpoint's metadata (bindings in the order they were made)."""
        return {"keys": dict(self.keys), "key_names": dict(self.key_names),
                "banned_ids": sorted(self.banned_ids), "banned_keys": sorted(self.banned_keys)}

    @classmethod
    def from_dict(cls, d: object) -> "AccessList":
        """The inverse of :meth:`to_dict`; ``AccessError`` naming the field for anything else."""
        if not isinstance(d, dict):
            raise AccessError(f"access state must be a map, got {type(d).__name__}")
        access = cls()
        for name in ("keys", "key_names"):
            m = d.get(name, {})
            if not isinstance(m, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in m.items()):
                raise AccessError(f"access state {name!r} must map strings to strings")
        for name in ("banned_ids", "banned_keys"):
            s = d.get(name, [])
            if not isinstance(s, list) or not all(isinstance(x, str) for x in s):
                raise AccessError(f"access state {name!r} must be a list of strings")
        access.keys = dict(d.get("keys", {}))
        access.key_names = dict(d.get("key_names", {}))
        access.banned_ids = set(d.get("banned_ids", []))
        access.banned_keys = set(d.get("banned_keys", []))
        return access
