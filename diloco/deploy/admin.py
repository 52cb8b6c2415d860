"""The operator's side: ``status``, ``shutdown``, ``set-min-workers`` and ``kick`` over ZeroMQ.

Each command is one ``AdminRequest`` from a short-lived DEALER to the
coordinator's ROUTER (the same address the workers use), answered by one
``AdminReply``. Nothing waits longer than ``timeout_s``: a coordinator that
does not answer is reported unreachable (exit code 3), never a hang.
"""

from __future__ import annotations

import io
from typing import Any

from diloco.wire.messages import AdminReply, AdminRequest
from diloco.wire.zmq import CoordinatorUnreachable, admin_request

__all__ = ["request", "render_status", "CoordinatorUnreachable"]


def request(address: str, command: str, args: dict[str, Any] | None = None, *, timeout_s: float = 5.0,
            auth=None) -> AdminReply:
    """One admin round trip (``auth``: a ``ClientAuth`` for a coordinator run with ``--auth``).

    Raises ``CoordinatorUnreachable`` after ``timeout_s`` and ``AuthRefused`` when the key is refused.
    """
    return admin_request(address, AdminRequest(command, dict(args or {})), timeout_s=timeout_s, auth=auth)


def _age(seconds: float | None) -> str:
    """An age or a duration in words an operator reads at a glance: 4.2 s, 3.5 min, 2.1 h, 1.5 d."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _size(nbytes: int | None) -> str:
    """A byte count as people read it: ``64 KiB``, ``16 MiB``; ``-`` when unknown."""
    if not nbytes:
        return "-"
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"


def _num(value, digits: int) -> str:
    return "-" if not isinstance(value, (int, float)) or isinstance(value, bool) else f"{value:.{digits}f}"


def render_status(status: dict, address: str = "", *, width: int = 120) -> str:
    """A readable page of ``status`` (the coordinator's status dict), as plain text via rich."""
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False)
    below = status.get("below_min_workers")
    live = len(status.get("members", []))
    stopped = f" ({status.get('stop_kind')})" if status.get("stopped") else ""
    console.print(f"coordinator {address}  phase [b]{status.get('phase', '?').upper()}[/b]{stopped}  "
                  f"mode {status.get('mode', '?')}  rounds applied {status.get('rounds_applied', 0)}")
    gate = "BELOW min_workers: nothing applies" if below else "quorum met"
    console.print(f"quorum: {live} live / min_workers {status.get('min_workers')}: {gate}")
    console.print(f"  reason: {status.get('quorum_reason', '')}", soft_wrap=True)
    paused = status.get("paused_s") or 0.0
    console.print(f"  paused {paused:.1f} s in total; {status.get('contributions_accepted', 0)} contributions "
                  f"accepted; {status.get('num_params', 0)} params; outer {status.get('outer_optimizer', '?')}")
    if "uptime_s" in status:
        since = status.get("since_last_apply_s")
        console.print(f"run {status.get('run_id') or '-'} (incarnation {status.get('incarnation', '?')}, diloco "
                      f"{status.get('version', '?')}): up {_age(status.get('uptime_s'))}; last round "
                      f"{'none yet' if since is None else _age(since) + ' ago'}; "
                      f"{_num(status.get('rounds_per_hour'), 1)} rounds/hour")

    tokens = status.get("tokens") or {}
    if tokens.get("budget") is not None:
        eta, rate = tokens.get("eta_s"), tokens.get("tokens_per_s")
        pace = f"ETA {_age(eta)} at {_num(rate, 1)} tokens/s" if eta is not None else "no rate yet"
        console.print(f"token budget: {tokens.get('trained', 0):,} of {tokens['budget']:,} tokens trained "
                      f"({100 * (tokens.get('fraction') or 0):.1f} %); {pace} (`diloco set-token-budget` "
                      f"changes it)")
    units = status.get("units") or {}
    if units:
        console.print(f"data units: epoch {units['epoch']}: {units['finished']:,} of {units['units']:,} finished; "
                      f"{units['held']} held, {units['in_flight']} in flight; {units['epochs_done']} epochs done")

    members = Table(title="members", title_justify="left", show_edge=False)
    members.add_column("worker")
    members.add_column("last heartbeat", justify="right")
    parked = set(status.get("parked_workers", []))
    members.add_column("state")
    for col in ("step", "steps/s", "loss", "eval loss"):
        members.add_column(col, justify="right")
    awaited = {w for f in status.get("fragments", []) for w in f.get("awaited", [])}
    for m in status.get("members", []):
        wid = m.get("worker_id")
        state = "parked at barrier" if wid in parked else ("training" if wid in awaited else "")
        mx = m.get("metrics") or {}
        members.add_row(str(wid), _age(m.get("age_s", 0.0)) + " ago", state, _num(mx.get("step"), 0),
                        _num(mx.get("steps_per_s"), 1), _num(mx.get("loss"), 4), _num(mx.get("eval_loss"), 4))
    if not status.get("members"):
        members.add_row("(none)", "", "", "", "", "", "")
    console.print(members)

    frags = Table(title="open rounds", title_justify="left", show_edge=False)
    for col in ("fragment", "round", "contributed (parked)", "awaited", "held (async)"):
        frags.add_column(col)
    for f in status.get("fragments", []):
        frags.add_row(str(f.get("fragment_id")), str(f.get("round_id")),
                      ", ".join(f.get("contributed", [])) or "-", ", ".join(f.get("awaited", [])) or "-",
                      ", ".join(f.get("held", [])) or "-")
    console.print(frags)
    gone_parked = [w for w in status.get("parked_workers", []) if w not in {m.get("worker_id") for m in
                                                                          status.get("members", [])}]
    if parked:
        console.print(f"parked workers: {', '.join(status.get('parked_workers', []))}"
                      + (f" (departed, contribution kept: {', '.join(gone_parked)})" if gone_parked else ""))
    if status.get("banned_workers") or status.get("banned_keys"):
        console.print(f"banned (kick --ban; `diloco unban WORKER` lifts it): workers "
                      f"{', '.join(status.get('banned_workers', [])) or '-'}; keys "
                      f"{', '.join(status.get('banned_keys', [])) or '-'}")
    t = status.get("transport")
    if t:
        malformed = t.get("malformed_total", 0)
        by_code = ", ".join(f"{k} {v}" for k, v in sorted((t.get("malformed") or {}).items()))
        console.print(f"transport: {t.get('messages_in', 0)} messages in, {t.get('messages_out', 0)} out; "
                      f"malformed {malformed}{f' ({by_code})' if by_code else ''}; "
                      f"refused {status.get('messages_refused', 0)}")
        if "auth" in t:
            console.print(f"  auth: {'CURVE' if t.get('auth') else 'none'}; keys refused {t.get('auth_failures', 0)}; "
                          f"forbidden messages {t.get('forbidden', 0)}; incomplete messages dropped "
                          f"{t.get('incomplete_dropped', 0)}")
        if t.get("part_bytes_in") or t.get("part_bytes_out"):  # how tensors are cut on the links (SPEC.md 11)
            console.print(f"  parts (median over workers): in {_size(t.get('part_bytes_in'))}, "
                          f"out {_size(t.get('part_bytes_out'))}")
        dropped = t.get("dropped_queue_full", 0) + t.get("dropped_unroutable", 0)
        if dropped or t.get("handshake_failures", 0):
            console.print(f"  dropped {t.get('dropped_queue_full', 0)} (queue full) + {t.get('dropped_unroutable', 0)} "
                          f"(peer gone); handshake failures {t.get('handshake_failures', 0)}")
    cfg = status.get("config")
    if isinstance(cfg, dict):
        fsm, outer = cfg.get("fsm") or {}, cfg.get("outer") or {}
        window = f" (grace window {fsm['grace_window_s']:g} s)" if fsm.get("grace_window_s") else ""
        console.print(f"config: mode {fsm.get('mode', '?')}{window}, {fsm.get('num_fragments', '?')} fragment(s), heartbeat "
                      f"timeout {fsm.get('heartbeat_timeout_s', '?')} s, outer {outer.get('name', '?')} lr "
                      f"{outer.get('lr', '?')} momentum {outer.get('momentum', '?')}, max update norm "
                      f"{cfg.get('max_update_norm') or 'off'}, wire dtype {cfg.get('wire_dtype', 'fp32')}, "
                      f"DyLU {'on at H ' + str(cfg.get('sync_every')) if cfg.get('dylu') else 'off'}, "
                      f"data plane {fsm.get('data_plane', 'hub')}", soft_wrap=True)
    plane = status.get("collective")
    if isinstance(plane, dict):
        commits = ", ".join(f"f{i} r{r} {d[:12]}" for i, (r, d) in enumerate(plane.get("last_commit", [])) if r >= 0)
        console.print(f"collective: {plane.get('commits', 0)} commits, {plane.get('aborts', 0)} aborted attempts, "
                      f"{plane.get('heals', 0)} heals, group epoch {plane.get('epoch', 0)}, holders "
                      f"{plane.get('holders', [])}; last commits {commits or 'none'}", soft_wrap=True)
        checks = plane.get("checks") or {}
        if checks.get("evictions") or checks.get("blames_disputed") or checks.get("strikes"):
            strikes = ", ".join(f"{w} {n}" for w, n in sorted(checks.get("strikes", {}).items()))
            console.print(f"  checks: {checks.get('evictions', 0)} evictions (strikes: {strikes or 'none'}), "
                          f"{checks.get('blames_disputed', 0)} disputed blames", soft_wrap=True)
    if status.get("stop_reason"):
        console.print(f"stopped because: {status['stop_reason']}", soft_wrap=True)
    return buf.getvalue().rstrip() + "\n"
