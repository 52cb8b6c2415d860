"""What ``diloco server`` says about the run as it starts: one line per setting that shapes it.

Kept apart from ``server.py`` (which builds and runs the server) because every
new setting adds a line here, and a reader looking for what a flag prints
finds all of them in one place.
"""

from __future__ import annotations

import os

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.persist import describe_policy, resume_notes
from diloco.core import Mode


def startup_lines(coordinator: Coordinator, s, address: str, store_host, auth) -> list[str]:
    """The lines printed as the server starts: address, mode and outer optimizer, wire dtype, data plane,
    DyLU, the bounds on contributions, auth, what a resume found, durability (``s``: ``ServerSettings``)."""
    cfg = coordinator.config
    fsm = coordinator.fsm
    lines = [f"diloco server listening on {address}",
             f"  mode {cfg.fsm.mode.value}, {cfg.fsm.num_fragments} fragment(s), min_workers {fsm.min_workers}, "
             f"heartbeat timeout {cfg.fsm.heartbeat_timeout_s:g} s "
             f"(workers beat every {cfg.heartbeat_interval_s:g} s), "
             f"outer {cfg.outer.name} lr {cfg.outer.lr:g} momentum {cfg.outer.momentum:g}"
             f"{momentum_schedule(cfg.outer)}",
             f"  {wire_line(cfg)}"]
    if cfg.fsm.grace_window_s:
        length = (f"auto (set from the arrivals at every close, at most {cfg.fsm.grace_window_s:g} s)"
                  if cfg.grace_auto else f"{cfg.fsm.grace_window_s:g} s")
        lines.append(f"  grace window {length}: contributions within it merge into one outer "
                     f"step (their mean); it closes early once every live worker is in, at once on a departure")
    if store_host is not None:
        lines.append(f"  data plane collective: workers all-reduce among themselves (gloo) on the store at "
                     f"{store_host.host}:{store_host.port}; each collective bounded by {cfg.collective_timeout_s:g} s, "
                     f"an attempt by {cfg.fsm.reduce_timeout_s:g} s; this server holds no params")
    if cfg.token_weighted:
        lines.append(f"  merge: contributions weighted by the tokens they trained on (--merge {cfg.merge})")
    if coordinator.budget.budget is not None:
        lines.append(f"  token budget {coordinator.budget.budget:,}: the run stops as shutdown --save does once "
                     f"applied rounds trained on that many ({coordinator.budget.trained:,} so far)")
    if coordinator.units.enabled:
        u = coordinator.units.status()
        lines.append(f"  data units: {u['units']:,} per epoch, handed out one per worker per round, each finished "
                     f"once its round applies (epoch {u['epoch']}, {u['finished']:,} finished)")
    if cfg.dylu:
        lines.append(f"  DyLU: each worker takes H_w = max(1, floor(v_w / v_max * {cfg.sync_every})) inner steps per "
                     f"round (v: its training speed; the fastest keeps {cfg.sync_every}; no measurement yet: "
                     f"{cfg.sync_every})")
    if cfg.max_update_norm is not None:
        lines.append(f"  max update norm {cfg.max_update_norm:g}: contributions with a larger L2 norm are refused "
                     f"(update_too_large)")
    if cfg.outlier_factor > 0:
        lines.append(f"  outlier bound: a contribution whose L2 norm is over {cfg.outlier_factor:g} x the median of "
                     f"the fragment's last accepted ones is refused (update_too_large; --outlier-factor 0: off)")
    if auth is not None:
        roles = [c.role.value for c in auth.clients.values()]
        lines.append(f"  auth: CURVE, {roles.count('worker')} worker key(s) and {roles.count('admin')} admin key(s) "
                     f"from {auth.directory}")
    else:
        lines.append("  auth: none (anyone who reaches the address can join or run admin commands)")
    if coordinator.resumed_from is not None:
        lines.append(f"  resumed from {coordinator.resumed_from}: open rounds {list(fsm.open_round_ids())}, "
                     f"rounds applied {fsm.rounds_applied}, {coordinator.plane.num_params()} params, "
                     f"incarnation {coordinator.incarnation}")
        lines += [f"  {note}" for note in resume_notes(coordinator.resume_replayed, coordinator.resume_torn)]
    if s.checkpoint_dir:
        lines.append(f"  durable rounds: every applied round is written to {s.checkpoint_dir} before any worker "
                     f"hears of it ({describe_policy(s.full_checkpoint_every)}; newest {s.keep} kept); audit log "
                     f"{os.path.join(s.checkpoint_dir, 'events.jsonl')}")
    return lines


def momentum_schedule(outer) -> str:
    """The start-up line's words for a momentum warm-up or decay (empty without one)."""
    words = []
    if outer.momentum_warmup:
        words.append(f"warm-up over {outer.momentum_warmup} steps")
    if outer.momentum_decay_rounds:
        words.append(f"decay to {outer.momentum_final:g} over steps {outer.momentum_decay_start}.."
                     f"{outer.momentum_decay_start + outer.momentum_decay_rounds - 1}")
    return f" ({', '.join(words)})" if words else ""


def wire_line(cfg: CoordinatorConfig) -> str:
    """What travels in which dtype, for the start-up lines."""
    dt = cfg.wire_dtype
    wire = cfg.sparse_wire
    if wire is not None:
        fmt = wire.fmt
        return (f"wire dtype sparse: each worker sends the top {fmt.k} of every {fmt.chunk} entries of its "
                f"accumulator (beta {wire.beta:g}), 2 bits a value and an fp32 scale per chunk "
                f"({fmt.nbytes(1 << 20) / (4 << 20):.2%} of fp32); each Result carries the round's payloads; "
                f"outer step theta - {wire.lr:g} * mean(sent)")
    size = {"fp32": "4 bytes per parameter", "bf16": "2 bytes per parameter",
            "int8": "1 byte per parameter plus an fp32 scale per 256",
            "int4": "half a byte per parameter plus an fp32 scale per 64"}[dt]
    if dt == "fp32":
        return f"wire dtype fp32: pseudo-gradients and Results travel as fp32 ({size})"
    if cfg.fsm.mode is Mode.ASYNC:
        return (f"wire dtype {dt}: pseudo-gradients travel as {dt} ({size}); Results as full fp32 "
                f"params (async mode); outer step in fp32")
    return (f"wire dtype {dt}: pseudo-gradients and each round's update travel as {dt} ({size}); "
            f"outer step in fp32")
