"""``diloco worker``: one worker process, from a training setup to a finished run.

Loads the setup (``--entry module:function`` or the built-in demo), connects
a ``ZmqWorkerEndpoint`` to the coordinator, wraps model and optimizer in a
``DilocoWorker`` and runs ``run_training`` until the coordinator stops the
run (or ``--max-steps``). Prints a line per round synced and per state worth
knowing (joining, paused, stopped). Exit codes: 0 stopped cleanly (told to
stop, drained, saved, or reached ``--max-steps``); 1 the run refused this
worker or training failed; 2 bad ``--entry``; 3 coordinator unreachable: the
worker gave up after ``--coordinator-timeout`` seconds without a word from the
coordinator, in whatever phase (joining, training, waiting for a Result,
paused), its checkpoint written first if it has a ``--checkpoint-dir`` (a
supervisor should restart it); 4 the coordinator refused this worker's key;
130 Ctrl-C. SIGTERM asks the worker to stop (saving its checkpoint if it has a
``--checkpoint-dir``) and exits 0.

While the coordinator is silent the worker prints a line after 5 s and then
every 10 s (how long, what it waits for, the limit), and one when the
coordinator answers again (a coordinator restarted on the same address: the
worker re-joins and the run goes on).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

from diloco.exits import EXIT_AUTH_REFUSED, EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE, UsageError

DEFAULT_ENTRY = "diloco.deploy.default_entry:make_setup"


def load_entry(spec: str) -> Callable[..., Any]:
    """``module:function`` or ``path/to/file.py:function`` -> the function. Raises ``UsageError``."""
    module_name, sep, func_name = spec.rpartition(":")
    if not sep or not module_name or not func_name:
        raise UsageError(f"--entry {spec!r}: expected module:function (or path/to/file.py:function)")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise UsageError(f"--entry {spec!r}: no such file {path}")
            mod_spec = importlib.util.spec_from_file_location(f"diloco_entry_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            # Registered first, as an import would: dataclasses (and pickle) look a module up in
            # sys.modules, so a file with ``from __future__ import annotations`` and a dataclass fails otherwise.
            sys.modules[mod_spec.name] = module
            try:
                mod_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(mod_spec.name, None)
                raise
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # like `python -m`: your module in the current directory
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"--entry {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UsageError(f"--entry {spec!r}: {module_name!r} has no function {func_name!r}")
    return func


def call_entry(func: Callable[..., Any], worker_id: str, **context: Any):
    """Call the entry with the keywords it takes; check it returned a ``TrainingSetup``.

    It may take ``worker_id`` and any of ``context`` (``rank``, ``world_size``,
    ``device``: where this process sits in a multi-rank worker, for sharding data).
    """
    from diloco.worker import TrainingSetup

    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    offered = {"worker_id": worker_id, **context}
    setup = func(**{k: v for k, v in offered.items() if takes_any or k in params})
    if not isinstance(setup, TrainingSetup):
        raise UsageError(f"the entry function returned {type(setup).__name__}; expected diloco.worker.TrainingSetup")
    return setup


class _Printer:
    """Worker progress on stdout: joins, pauses, rounds synced (with the last loss), the stop."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.worker = None
        self.last_loss = math.nan
        self._last_state = None
        self._rounds_printed = 0

    def line(self, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {self.worker_id} {text}", flush=True)

    def loss_fn(self, inner: Callable):
        def wrapped(model, batch):
            loss = inner(model, batch)
            try:
                self.last_loss = float(loss.detach())
            except Exception:  # a loss that is not a scalar tensor: just do not print it
                pass
            return loss
        return wrapped

    def attach(self, worker) -> None:
        self.worker = worker
        self._rounds_printed = worker.rounds_synced

    def on_state(self, worker_id: str, state: str, t: float) -> None:
        w = self.worker
        prev, self._last_state = self._last_state, state
        if w is not None and w.rounds_synced > self._rounds_printed:
            self._rounds_printed = w.rounds_synced
            loss = "-" if math.isnan(self.last_loss) else f"{self.last_loss:.3f}"
            self.line(f"synced: next round {list(w.round_ids)}, inner step {w.inner_step}, loss {loss}, "
                      f"update norm {w.last_update_norm:.4g}")
        if w is None or state == prev:
            return
        if state == "joining":
            self.line("joining" if prev is None else "joining again")
        elif state == "paused":
            self.line(f"paused: the run is below quorum (min_workers {w.min_workers}); waiting at the sync point")
        elif prev == "paused" and state in ("waiting", "training"):
            self.line("resumed: quorum is back")
        elif state == "stopped":
            self.line(f"stopped ({w.stop_reason})")

    def on_outage(self, kind: str, waited_s: float, what: str, limit_s: float) -> None:
        if kind == "waiting":
            self.line(f"coordinator unreachable for {waited_s:.0f} s: waiting for {what} "
                      f"(gives up after {limit_s:g} s, --coordinator-timeout)")
        elif kind == "back":
            self.line(f"coordinator answered again after {waited_s:.0f} s")
        elif kind == "gave_up":
            self.line(f"coordinator unreachable for {waited_s:.0f} s (waiting for {what}): giving up "
                      f"(--coordinator-timeout {limit_s:g})")


def overlap_options(args, sync_every: int) -> dict:
    """``--overlap-steps`` / ``--overlap-alpha`` -> DilocoWorker keyword arguments; ``UsageError`` if they do not fit."""
    steps = getattr(args, "overlap_steps", 0) or 0
    alpha = getattr(args, "overlap_alpha", None)
    if steps >= sync_every:
        raise UsageError(f"--overlap-steps {steps}: must be less than --sync-every {sync_every} (a fragment syncs "
                         f"every {sync_every} inner steps; its round's params must be merged before its next sync)")
    if alpha is not None and not steps:
        raise UsageError("--overlap-alpha needs --overlap-steps T >= 1 (without overlap nothing is merged)")
    return {"overlap_steps": steps} if alpha is None else {"overlap_steps": steps, "overlap_alpha": alpha}


def run_worker_command(args) -> int:
    import torch

    from diloco.worker.device import resolve_device
    from diloco.worker.group import RankInfo, init_group

    torch.set_num_threads(args.threads)
    if not args.connect.startswith(("tcp://", "ipc://")):
        raise UsageError(f"--connect {args.connect!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    try:
        info = RankInfo.from_env()
        device = resolve_device(args.device, info.local_rank)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if info.world_size > 1 and not args.worker_id:
        raise UsageError("a multi-rank worker (torchrun) needs --id: every rank must name the same worker")
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    entry = args.entry or DEFAULT_ENTRY
    sync_every = args.sync_every
    if sync_every is None:
        if args.entry is None:
            from diloco.deploy.default_entry import SYNC_EVERY
            sync_every = SYNC_EVERY
        else:
            sync_every = 100
    overlap = overlap_options(args, sync_every)
    func = load_entry(entry)
    created = init_group(info, device)

    def run() -> int:
        context = {"rank": info.rank, "world_size": info.world_size, "device": device}
        setup = call_entry(func, worker_id, **context)
        setup.model.to(device)
        if info.is_leader:
            return _run_leader(args, setup, worker_id, sync_every, info, device, overlap)
        return _run_follower(args, setup, worker_id, info, device)

    if not created:  # no group, or one this process made before (a program that runs the command itself)
        return run()
    code = _run_in_group(run)
    torch.distributed.destroy_process_group()
    _end_process(code)
    return code  # not reached


def _run_in_group(run: Callable[[], int]) -> int:
    """``run()``'s exit code, errors reported as ``diloco``'s main reports them: a process in a
    group ends in ``_end_process``, never by unwinding to the interpreter's exit."""
    from diloco.exits import reported

    try:
        return reported("worker", run)
    except Exception:
        import traceback

        traceback.print_exc()
        return EXIT_PROBLEM


def _end_process(code: int) -> None:
    """End a process that joined a process group without the interpreter's finalization.

    FSDP2 keeps the group's ``ProcessGroup`` object alive after ``destroy_process_group`` (its
    mesh info holds it, and caches hold that), so gloo's threads would be torn down while the
    interpreter finalizes, which now and then aborts the process (SIGABRT, "terminate called
    without an active exception": one exit in about thirty on this kind of machine). Everything
    the worker writes is written and closed by now; flush what is buffered and leave."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _grad_sync(info, model):
    from diloco.worker.group import average_gradients
    from diloco.worker.shards import is_sharded

    if info.world_size <= 1 or is_sharded(model):
        return None  # FSDP2 reduce-scatters a sharded model's gradients itself
    return lambda model: average_gradients(model, info.world_size)


def _run_leader(args, setup, worker_id: str, sync_every: int, info, device, overlap: dict) -> int:
    from diloco.transport.zmq.options import ZmqOptions
    from diloco.wire.zmq import ZmqWorkerEndpoint
    from diloco.worker import DilocoWorker, run_training
    from diloco.worker.device import loss_on_device
    from diloco.worker.group import GroupLeader
    from diloco.worker.worker import DEFAULT_COORDINATOR_TIMEOUT_S, DilocoWorkerError

    printer = _Printer(worker_id)
    from diloco.deploy.options import client_auth

    coordinator_timeout = args.coordinator_timeout
    if coordinator_timeout is None:
        coordinator_timeout = DEFAULT_COORDINATOR_TIMEOUT_S

    auth = client_auth(args)
    options = ZmqOptions() if args.link_timeout is None else ZmqOptions(
        zmtp_heartbeat_timeout_ms=max(1, round(args.link_timeout * 1000)))
    endpoint = ZmqWorkerEndpoint(args.connect, label=worker_id, auth=auth, options=options)
    try:
        worker = DilocoWorker(setup.model, setup.optimizer, endpoint, worker_id=worker_id, sync_every=sync_every,
                              checkpoint_dir=args.checkpoint_dir, on_state=printer.on_state,
                              coordinator_timeout_s=coordinator_timeout, on_outage=printer.on_outage,
                              checkpoint_every=args.checkpoint_every,
                              error_feedback={"on": True, "off": False}.get(getattr(args, "error_feedback", "auto")),
                              **overlap)
    except DilocoWorkerError as exc:
        endpoint.close()
        raise UsageError(str(exc)) from None
    except ValueError as exc:
        endpoint.close()
        raise UsageError(str(exc)) from None
    printer.attach(worker)
    restored = (f", restored from its checkpoint at inner step {worker.inner_step}" if worker.restored else "")
    if worker.residual_restored:
        restored += f" with the error-feedback residual of {worker.residual_restored} params"
    overlapping = (f", overlap {worker.overlap_steps} steps (alpha {worker.overlap_alpha:g})"
                   if worker.overlap_steps else "")
    group = f", rank 0 of {info.world_size}" if info.world_size > 1 else ""
    where = f", device {device}" if device.type != "cpu" or info.world_size > 1 else ""
    printer.line(f"connecting to {args.connect} (routing id {endpoint.peer}), H={sync_every}{overlapping}{group}"
                 f"{where}{restored}")
    driver = GroupLeader(worker, info) if info.world_size > 1 else worker
    previous = signal.signal(signal.SIGTERM, lambda *_: worker.request_stop(save=args.checkpoint_dir is not None))
    try:
        report = run_training(driver, setup.batches, loss_on_device(printer.loss_fn(setup.loss_fn), device),
                              max_steps=args.max_steps, after_backward=_grad_sync(info, setup.model),
                              tokens_of=getattr(setup, "tokens_of", None),
                              unit_batches=getattr(setup, "unit_batches", None))
    except DilocoWorkerError as exc:
        code = getattr(exc, "code", None)
        print(f"diloco worker {worker_id}: {exc}", file=sys.stderr, flush=True)
        return EXIT_AUTH_REFUSED if code == "auth_refused" else EXIT_PROBLEM
    finally:
        signal.signal(signal.SIGTERM, previous)
        try:
            worker.leave()
        except Exception:
            pass
    saved = ""
    unreachable = report.stop_reason == "coordinator_unreachable"
    if (report.stop_reason == "save_and_stop" or unreachable) and worker.checkpoint_path is not None \
            and worker.checkpoint_path.exists():
        saved = f"; checkpoint {worker.checkpoint_path}"
    printer.line(f"done ({report.stop_reason}): {report.inner_steps} inner steps, {report.rounds_synced} rounds synced, "
                 f"{report.seconds_paused:.1f} s paused{saved}")
    if unreachable:
        print(f"diloco worker {worker_id}: the coordinator at {args.connect} was unreachable for "
              f"{coordinator_timeout:g} s (--coordinator-timeout){saved}; exit 3", file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
    return EXIT_OK


def _run_follower(args, setup, worker_id: str, info, device) -> int:
    """A rank > 0 of a multi-rank worker: train in step with rank 0, which alone talks to the coordinator."""
    from diloco.worker import run_training
    from diloco.worker.device import loss_on_device
    from diloco.worker.group import GroupFollower
    from diloco.worker.worker import DilocoWorkerError

    printer = _Printer(f"{worker_id}[rank {info.rank}]")
    printer.line(f"rank {info.rank} of {info.world_size}, device {device}: following rank 0")
    follower = GroupFollower(setup.model, setup.optimizer, worker_id, info)
    # SIGTERM reaches every rank (torchrun forwards it); rank 0 decides and tells the others.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        report = run_training(follower, setup.batches, loss_on_device(setup.loss_fn, device),
                              max_steps=args.max_steps, after_backward=_grad_sync(info, setup.model))
    except DilocoWorkerError as exc:
        print(f"diloco worker {worker_id} rank {info.rank}: {exc}", file=sys.stderr, flush=True)
        return EXIT_PROBLEM
    finally:
        signal.signal(signal.SIGTERM, previous)
    printer.line(f"done ({report.stop_reason}): {report.inner_steps} inner steps, {report.rounds_synced} rounds synced")
    if report.stop_reason == "coordinator_unreachable":
        return EXIT_UNREACHABLE
    if report.stop_reason and report.stop_reason.startswith("error"):
        return EXIT_PROBLEM
    return EXIT_OK
