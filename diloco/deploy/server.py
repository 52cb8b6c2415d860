"""``diloco server``: the coordinator as a process, on a ZeroMQ ROUTER.

It wires three existing parts together: ``ZmqCoordinatorEndpoint`` (bytes),
``Coordinator`` (the sans-IO service around ``RoundFSM``) and
``coordinator.runner.serve`` (the real-time loop that, with a checkpoint
directory, writes every applied round and the save-and-stop checkpoint
*before* telling anyone, SPEC.md section 5). What it adds: a line on stdout
per join, death, leave, quorum change, phase change, applied round and stop;
the audit log ``events.jsonl``; the transport's counters in every status
reply; a resume from the newest valid checkpoint; a clean exit on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
import uuid
from typing import TextIO

from diloco import __version__
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.audit import AuditLog, Tee, last_run_id
from diloco.coordinator.checkpoint import DEFAULT_KEEP, find_newest, list_checkpoints, restore_coordinator
from diloco.coordinator.runner import serve
from diloco.deploy.events import EventPrinter
from diloco.core import ConfigError, Mode
from diloco.deploy.options import DEFAULT_GRACE_CEILING_S, DEFAULT_HEAL_SOURCES, DEFAULT_WIRE_DTYPE
from diloco.wire.sparse import DEFAULT_OUTER_LR as SPARSE_OUTER_LR
from diloco.deploy.startup import startup_lines
from diloco.ckptio import CheckpointError
from diloco.wire.endpoints import CoordinatorEndpoint
from diloco.wire.messages import AdminRequest
from diloco.wire.zmq import ZmqCoordinatorEndpoint, ZmqOptions


class ServerError(Exception):
    """The server cannot start (bad settings, unusable address, unreadable checkpoint)."""


@dataclasses.dataclass
class ServerSettings:
    bind: str = "tcp://127.0.0.1:5555"
    min_workers: int | None = None
    heartbeat_timeout_s: float | None = None
    checkpoint_dir: str | None = None
    #: ``--keep K``: checkpoint files kept in ``checkpoint_dir`` (the newest K).
    keep: int = DEFAULT_KEEP
    #: ``--full-checkpoint-every N|auto``: rounds between full checkpoints, the journal in between
    #: (``persist.py``; 0: auto, 1: a full checkpoint every round).
    full_checkpoint_every: int = 0
    mode: str | None = None
    #: ``--grace-window S``: async contributions within S seconds merge into one outer step (SPEC.md P5);
    #: None: not given, so 0, or on resume the checkpoint's. "auto": the window set from the arrivals, at
    #: most ``grace_window_max_s`` (``--grace-window-max``; None: ``DEFAULT_GRACE_CEILING_S``).
    grace_window_s: float | str | None = None
    grace_window_max_s: float | None = None
    fragments: int | None = None
    outer_optimizer: str | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    #: ``--outer-momentum-warmup`` (outer steps) and ``--outer-momentum-decay`` (start, steps, final).
    outer_momentum_warmup: int | None = None
    outer_momentum_decay: tuple[int, int, float] | None = None
    resume: str | None = None
    max_message_bytes: int | None = None
    #: ``--link-timeout``: seconds a connection may deliver no whole frame before it is re-opened
    #: (None: ``ZmqOptions``' default).
    link_timeout_s: float | None = None
    #: Seconds to keep answering after the run stops, so every worker hears it (default: 3 heartbeats).
    linger_s: float | None = None
    #: ``--max-update-norm``: refuse contributions with a larger L2 norm (0: no limit; None: not given,
    #: so the default, no limit, or on resume the checkpoint's).
    max_update_norm: float | None = None
    #: ``--outlier-factor F``: refuse contributions F times the recent median norm (0: off; None: default/saved).
    outlier_factor: float | None = None
    #: ``--max-failed-attempts N`` (collective): stop after N failed attempts in a row of one round (None:
    #: default/saved).
    max_failed_attempts: int | None = None
    #: ``--wire-dtype``: fp32, bf16 or int8 (None: not given, so ``DEFAULT_WIRE_DTYPE``, or on resume
    #: the checkpoint's).
    wire_dtype: str | None = None
    #: ``--dylu``: each worker takes H_w = max(1, floor(v_w / v_max * H)) inner steps per round (None: not
    #: given, so off, or on resume the checkpoint's); ``--sync-every H`` is its reference H.
    dylu: bool | None = None
    #: ``--merge auto|uniform|tokens`` (None: not given, so auto, or on resume the saved one).
    merge: str | None = None
    #: ``--token-budget N`` (None: not given: no budget, or on resume the saved one).
    token_budget: int | None = None
    #: ``--data-units N`` (None: not given: none, or on resume the saved run's).
    data_units: int | None = None
    sync_every: int | None = None
    #: ``--auth DIR``: CURVE keys and roles (``diloco.transport.zmq.auth.ServerAuth``); None: no authentication.
    auth_dir: str | None = None
    #: ZeroMQ I/O threads (default 1, or 2 with authentication: CURVE runs on them).
    io_threads: int | None = None
    #: ``--http HOST:PORT``: the dashboard, /api/status and /metrics (None: off). Port 0 picks a free one.
    http: str | None = None
    #: ``--log-dir DIR``: the JSONL metrics log DIR/metrics.jsonl (None: off).
    log_dir: str | None = None
    #: ``--data-plane hub|collective`` (None: hub, or on resume the saved plane) and its options.
    data_plane: str | None = None
    collective_timeout_s: float | None = None
    #: ``--heal-sources K`` (None: not given, so ``DEFAULT_HEAL_SOURCES``, or on resume the saved value).
    heal_sources: int | None = None
    #: ``--sparsity``, ``--sparse-chunk``, ``--sparse-beta`` (None: the defaults, or on resume the saved ones).
    sparsity: float | None = None
    sparse_chunk: int | None = None
    sparse_beta: float | None = None
    trusted_data_network: bool = False


def build_config(s: ServerSettings, base: CoordinatorConfig | None = None) -> CoordinatorConfig:
    """Settings -> config; on resume, ``base`` is the saved config and only given settings override it."""
    wire_dtype = s.wire_dtype or (base.wire_dtype if base is not None else DEFAULT_WIRE_DTYPE)
    heal_sources = s.heal_sources or (base.heal_sources if base is not None else DEFAULT_HEAL_SOURCES)
    base = base or CoordinatorConfig()
    fsm = base.fsm
    changes = {}
    auto = s.grace_window_s == "auto" or (s.grace_window_s is None and base.grace_auto)
    if s.grace_window_max_s is not None and not auto:
        raise ServerError("--grace-window-max bounds --grace-window auto: give --grace-window auto with it")
    window = s.grace_window_s
    if s.grace_window_s == "auto":
        window = s.grace_window_max_s or min(DEFAULT_GRACE_CEILING_S,
                                             s.heartbeat_timeout_s or fsm.heartbeat_timeout_s)
    elif auto and s.grace_window_max_s is not None:
        window = s.grace_window_max_s  # a resumed auto run's new ceiling
    for field, value in (("min_workers", s.min_workers), ("heartbeat_timeout_s", s.heartbeat_timeout_s),
                         ("mode", s.mode), ("num_fragments", s.fragments), ("data_plane", s.data_plane),
                         ("grace_window_s", window)):
        if value is not None:
            changes[field] = value
    if window and (s.mode or fsm.mode.value) != "async":
        given = "auto" if auto else f"{window:g}"
        raise ServerError(f"--grace-window {given} needs --mode async: a sync round already merges "
                          f"every worker's contribution")
    if s.data_plane == "collective" and (s.mode or fsm.mode.value) == "async":
        raise ServerError("--data-plane collective runs in sync mode only: an async contribution is its own "
                          "outer step, applied on the coordinator (use the hub plane for --mode async)")
    outer = base.outer
    decay = s.outer_momentum_decay or (None, None, None)
    outer_changes = {k: v for k, v in (("name", s.outer_optimizer), ("lr", s.outer_lr),
                                        ("momentum", s.outer_momentum),
                                        ("momentum_warmup", s.outer_momentum_warmup),
                                        ("momentum_decay_start", decay[0]), ("momentum_decay_rounds", decay[1]),
                                        ("momentum_final", decay[2])) if v is not None}
    try:
        if changes:
            fsm = dataclasses.replace(fsm, **changes)
        if outer_changes:
            outer = dataclasses.replace(outer, **outer_changes)
        hb_interval = base.heartbeat_interval_s if s.heartbeat_timeout_s is None else 0.0
        if fsm.mode is Mode.SYNC and outer.name == "delayed_nesterov" and "name" not in outer_changes:
            outer = dataclasses.replace(outer, name="nesterov")
        if wire_dtype == "sparse" and "name" not in outer_changes and outer.name != "sgd":
            # SparseLoCo's outer step: theta - lr * mean(sent), no global momentum.
            outer = dataclasses.replace(outer, name="sgd", momentum=outer_changes.get("momentum", 0.0),
                                        lr=outer_changes.get("lr", SPARSE_OUTER_LR))
        if wire_dtype != "sparse" and any(v is not None for v in (s.sparsity, s.sparse_chunk, s.sparse_beta)):
            raise ServerError("--sparsity, --sparse-chunk and --sparse-beta set the sparse wire: they need "
                              "--wire-dtype sparse")
        max_norm = base.max_update_norm if s.max_update_norm is None else (s.max_update_norm or None)
        outlier_factor = base.outlier_factor if s.outlier_factor is None else s.outlier_factor
        dylu = base.dylu if s.dylu is None else s.dylu
        merge = base.merge if s.merge is None else s.merge
        token_budget = base.token_budget if s.token_budget is None else s.token_budget
        data_units = base.data_units if s.data_units is None else s.data_units
        sync_every = base.sync_every if s.sync_every is None else s.sync_every
        if dylu and sync_every is None:
            raise ServerError("--dylu needs --sync-every H: the inner steps per round of the fastest worker "
                              "(slower workers get fewer)")
        collective_timeout = (s.collective_timeout_s if s.collective_timeout_s is not None
                              else 0.0 if s.heartbeat_timeout_s is not None else base.collective_timeout_s)
        if collective_timeout == 0.0:
            collective_timeout = fsm.heartbeat_timeout_s / 3
        if fsm.data_plane.value == "collective":
            # C7: op timeout < the core's reduce deadline < ... (the heartbeat timeout bounds the op too).
            fsm = dataclasses.replace(fsm, reduce_timeout_s=4 * collective_timeout)
        max_failed = base.max_failed_attempts if s.max_failed_attempts is None else s.max_failed_attempts
        return CoordinatorConfig(fsm=fsm, outer=outer, heartbeat_interval_s=hb_interval, max_update_norm=max_norm,
                                 outlier_factor=outlier_factor, max_failed_attempts=max_failed,
                                 wire_dtype=wire_dtype, dylu=dylu, sync_every=sync_every, merge=merge,
                                 token_budget=token_budget, data_units=data_units,
                                 collective_timeout_s=collective_timeout, heal_sources=heal_sources,
                                 sparsity=base.sparsity if s.sparsity is None else s.sparsity,
                                 sparse_chunk=base.sparse_chunk if s.sparse_chunk is None else s.sparse_chunk,
                                 sparse_beta=base.sparse_beta if s.sparse_beta is None else s.sparse_beta,
                                 grace_auto=auto)
    except (ConfigError, ValueError) as exc:
        raise ServerError(str(exc)) from None


def make_coordinator(s: ServerSettings, printer: EventPrinter, now_s: float,
                     observer=None, out: TextIO = sys.stdout) -> Coordinator:
    """A fresh coordinator, or with ``--resume`` the newest valid checkpoint's (SPEC.md section 12, "Resume").

    ``observer`` (default: the printer) hears the coordinator's events. Sets
    ``coordinator.resumed_from`` (the file, or None) and ``coordinator.resume_skipped``
    (newer files refused, with why).
    """
    observer = observer or printer
    found = None
    skipped: list = []
    if s.resume is not None:
        try:
            found = find_newest(s.resume)
        except CheckpointError as exc:
            raise ServerError(f"cannot resume: {exc}") from None
        if found is None:
            print(f"  --resume {s.resume}: no checkpoint there; starting a fresh run", file=out, flush=True)
        else:
            skipped = found.skipped
            for path, why in skipped:
                print(f"  WARNING: skipping checkpoint {path}: {why}; falling back to an older one",
                      file=out, flush=True)
    elif s.checkpoint_dir is not None:
        existing = [p for p in list_checkpoints(s.checkpoint_dir) if p.suffix == ".safetensors"]
        if existing:
            raise ServerError(f"--checkpoint-dir {s.checkpoint_dir} already holds checkpoints of a run (newest "
                              f"{existing[0].name}): pass --resume {s.checkpoint_dir} to continue it, or use an "
                              f"empty directory for a new run")
    if found is None:
        coordinator = Coordinator(build_config(s), now_s, observer=observer)
    else:
        path, meta, tensors = found.path, found.meta, found.tensors
        try:
            saved = CoordinatorConfig.from_dict(meta["config"])
            # The quorum in force when the run stopped (set-min-workers changes it at run
            # time) is the machine's, not the start-up config's: keep it unless overridden.
            live_min = meta["fsm"].get("min_workers") if isinstance(meta.get("fsm"), dict) else None
            if isinstance(live_min, int) and not isinstance(live_min, bool) and live_min != saved.fsm.min_workers:
                saved = dataclasses.replace(saved, fsm=dataclasses.replace(saved.fsm, min_workers=live_min))
        except CheckpointError as exc:
            raise ServerError(f"cannot resume: {exc}") from None
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise ServerError(f"cannot resume: {path}: the checkpoint's config is invalid ({exc})") from None
        # Restore with the quorum the snapshot was taken under (its phase agrees with it); a
        # --min-workers given now is then applied as the change it is, through the machine
        # (SPEC.md R8), so that it can pause (or resume) the run instead of contradicting it.
        config = build_config(dataclasses.replace(s, min_workers=None), saved)
        try:
            coordinator = restore_coordinator(meta, tensors, now_s, observer=observer, config=config)
        except CheckpointError as exc:
            raise ServerError(f"cannot resume: {path}: {exc}") from None
        if s.min_workers is not None and s.min_workers != coordinator.fsm.min_workers:
            before = coordinator.fsm.min_workers
            reply = coordinator.handle("--min-workers", AdminRequest("set_min_workers", {"min_workers": s.min_workers}),
                                       now_s)[-1][1]
            if not reply.ok:
                raise ServerError(f"--min-workers {s.min_workers}: {reply.error}")
            print(f"  min_workers {before} (saved) -> {s.min_workers} (--min-workers)", file=out, flush=True)
        if s.token_budget is not None and s.token_budget != coordinator.budget.budget:
            print(f"  token budget {coordinator.budget.budget} (saved) -> {s.token_budget} (--token-budget)",
                  file=out, flush=True)
            coordinator.budget.budget = s.token_budget
    coordinator.resumed_from = found.path if found is not None else None
    coordinator.resume_skipped = skipped
    coordinator.resume_replayed = found.replayed if found is not None else 0
    coordinator.resume_torn = found.torn if found is not None else []
    printer.coordinator = coordinator
    return coordinator


def warm_up(config: CoordinatorConfig) -> None:
    """Build and step a throwaway outer optimizer once.

    The first ``torch.optim`` optimizer a process builds imports ``torch._dynamo``,
    which takes seconds (4-8 s on a loaded 2-core machine). Done lazily, that
    stall would fall inside the first worker's join, and the next tick would find
    that worker silent for those seconds (and possibly declare it dead). So the
    server pays it before it starts listening.
    """
    import torch

    from diloco.outer import build_outer_optimizer

    p = torch.zeros(1)
    opt = build_outer_optimizer([p], config.outer, 1)
    p.grad = torch.zeros(1)
    opt.step()


def run_server(s: ServerSettings, out: TextIO = sys.stdout, stop_event: threading.Event | None = None) -> Coordinator:
    """Serve one run until it stops (or ``stop_event``/SIGTERM). Raises ``ServerError`` on bad settings."""
    if not s.bind.startswith(("tcp://", "ipc://")):
        raise ServerError(f"--bind {s.bind!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    auth = None
    if s.auth_dir is not None:
        from diloco.transport.zmq.auth import AuthError, ServerAuth
        try:
            auth = ServerAuth.load(s.auth_dir)
        except AuthError as exc:
            raise ServerError(str(exc)) from None
    printer = EventPrinter(out)
    if s.keep < 1:
        raise ServerError(f"--keep {s.keep}: keep at least 1 checkpoint")
    audit = None
    if s.checkpoint_dir is not None:
        try:
            audit = AuditLog(s.checkpoint_dir)
        except OSError as exc:
            raise ServerError(f"--checkpoint-dir {s.checkpoint_dir}: cannot open its audit log: {exc}") from None
    tee = Tee(printer, audit)
    try:
        coordinator = make_coordinator(s, printer, time.monotonic(), observer=tee, out=out)
    except BaseException:
        if audit is not None:
            audit.close()
        raise
    if coordinator.run_id is None:
        # A fresh run gets a new id; a resumed one keeps its checkpoint's (or its audit log's).
        coordinator.run_id = (last_run_id(audit.path) if audit is not None and s.resume is not None
                              else None) or uuid.uuid4().hex[:12]
    if audit is not None:
        audit.attach(coordinator)
        audit.record_start(resumed_from=str(coordinator.resumed_from) if coordinator.resumed_from else None,
                           replayed=coordinator.resume_replayed,
                           skipped=[str(p) for p, _ in coordinator.resume_skipped],
                           open_rounds=list(coordinator.fsm.open_round_ids()), min_workers=coordinator.fsm.min_workers,
                           mode=coordinator.config.fsm.mode.value, pid=os.getpid(), run_id=coordinator.run_id)
        audit.flush()
    warm_up(coordinator.config)
    store_host = None
    if coordinator.collective is not None:
        from diloco.collective.store import DataPlaneSecurityError, host_store

        try:
            store_host = host_store(coordinator, s.bind, s.trusted_data_network)
        except DataPlaneSecurityError as exc:
            raise ServerError(str(exc)) from None
    overrides = {}
    if s.max_message_bytes is not None:
        overrides["max_message_bytes"] = s.max_message_bytes
    if s.link_timeout_s is not None:
        overrides["zmtp_heartbeat_timeout_ms"] = max(1, round(s.link_timeout_s * 1000))
    io_threads = s.io_threads or (2 if auth is not None else 1)
    try:
        options = ZmqOptions(io_threads=io_threads, **overrides)
        endpoint = ZmqCoordinatorEndpoint(s.bind, options=options, auth=auth)
    except Exception as exc:
        raise ServerError(str(exc)) from None
    for line in startup_lines(coordinator, s, endpoint.address, store_host, auth):
        print(line, file=out, flush=True)
    print(f"  run id {coordinator.run_id}", file=out, flush=True)
    observing = None
    if s.http is not None or s.log_dir is not None:
        from diloco.observe.setup import ObserveError, start_observing

        try:
            observing = start_observing(coordinator, tee, version=__version__, http=s.http, log_dir=s.log_dir,
                                        out=out, auth_dir=s.auth_dir)
        except BaseException as exc:
            endpoint.close()
            if audit is not None:
                audit.close()
            if isinstance(exc, ObserveError):
                raise ServerError(str(exc)) from None
            raise
    coordinator.version = __version__
    coordinator.transport_stats = endpoint.stats
    served: CoordinatorEndpoint = endpoint
    if observing is not None:
        from diloco.observe.observatory import ObservedEndpoint

        served = ObservedEndpoint(served, observing.observatory)
    stop_event = stop_event or threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop_event.set())
    try:
        serve(served, coordinator, checkpoint_dir=s.checkpoint_dir, stop_event=stop_event,
              linger_s=s.linger_s, keep=s.keep, full_every=s.full_checkpoint_every, audit=audit)
    finally:
        if observing is not None:
            observing.close()
        endpoint.close()
        if audit is not None:
            audit.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if coordinator.stopped:
        kind = coordinator.stop_kind.value
        extra = ""
        if kind == "save_and_stop" and s.checkpoint_dir and coordinator.has_state:
            extra = f"; checkpoint {_newest(s.checkpoint_dir)}"
        print(f"run ended ({kind}) after {coordinator.fsm.rounds_applied} applied rounds{extra}", file=out, flush=True)
    else:
        saved = (f"; every applied round is in {_newest(s.checkpoint_dir)}" if s.checkpoint_dir
                 and coordinator.has_state else " (nothing saved)")
        print(f"server stopped by signal after {coordinator.fsm.rounds_applied} applied rounds{saved}",
              file=out, flush=True)
    return coordinator


def _newest(directory: str) -> str:
    paths = list_checkpoints(directory)
    return str(paths[0]) if paths else directory


__all__ = ["ServerSettings", "ServerError", "EventPrinter", "run_server", "build_config", "warm_up", "wire_line"]
