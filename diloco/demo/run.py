"""``diloco demo``: a real DiLoCo run in one process, with a fault, against two baselines.

k worker threads each train a replica of the char transformer on their own
i.i.d. shard with AdamW, through the real ``DilocoWorker`` library, talking to
the real ``Coordinator`` over the in-process transport. With faults on (the
default), ``min_workers`` equals k and one worker is killed mid-run: its
heartbeats stop, the coordinator declares it dead, the survivors pause at
their sync point (SPEC.md R5, R10), a replacement joins the open round
(P2) and the run resumes. Then fully synchronous data parallel and a single
worker train for the same number of inner steps, for comparison
(``diloco.baselines``).

This module does the work and reports through a ``DemoUI``; ``command.py``
owns the terminal (progress bars, table, RESULT line).
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco.baselines import (
    BaselineResult,
    comm_bytes_per_sync,
    inner_optimizer,
    inner_step,
    worker_samplers,
    train_single_worker,
    train_sync_data_parallel,
)
from diloco.coordinator import Coordinator, CoordinatorConfig, OuterConfig
from diloco.coordinator.runner import CoordinatorThread
from diloco.core import FSMConfig
from diloco.data import Corpus, derive_seed
from diloco.demo.config import DemoConfig, DemoError
from diloco.demo.waits import PROGRESS_EVERY_S, describe_worker, wait_until
from diloco.models import build_model, evaluate_loss, param_bytes
from diloco.plots.timeline import TimelineRecorder, WorkerState
from diloco.transport.inproc import InprocNetwork
from diloco.wire.messages import AdminRequest
from diloco.worker import DilocoWorker

#: Collective demo: the heartbeat timeout (the collective timeout is a third of it, SPEC.md C7).
COLLECTIVE_HEARTBEAT_S = 6.0


class DemoUI(Protocol):
    def phase(self, name: str, total: int) -> None: ...
    def advance(self, name: str, step: int, loss: float) -> None: ...
    def note(self, text: str) -> None: ...
    def finish(self, name: str, text: str) -> None: ...


@dataclass
class DemoResult:
    config: DemoConfig
    diloco: BaselineResult
    baseline: BaselineResult | None
    single: BaselineResult | None
    paused_s: float
    bytes_moved: int
    timeline: object
    events: list[tuple[float, str]]
    png: pathlib.Path | None = None


class _Run:
    """The DiLoCo part: coordinator thread, worker threads, the kill and the replacement."""

    def __init__(self, cfg: DemoConfig, corpus: Corpus, ui: DemoUI) -> None:
        self.cfg, self.corpus, self.ui = cfg, corpus, ui
        self.s = cfg.settings
        self.target_rounds = cfg.steps // cfg.sync_every
        # The victim crashes at a fixed step, halfway through the round after about a third
        # of the run, so what it trained (and what its replacement inherits) is the same on
        # every run with the same seed, however the threads are scheduled.
        self.kill_step = max(1, int(self.target_rounds * 0.35)) * cfg.sync_every + cfg.sync_every // 2 + 1
        self.t0 = time.monotonic()
        self.recorder = TimelineRecorder()
        self.events: list[tuple[float, str]] = []
        self.round_params: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.lock = threading.Lock()
        self.rounds_applied = 0
        self.below = False
        self.below_event = threading.Event()
        self.errors: list[tuple[str, BaseException]] = []
        #: The workers by id (for the diagnostics of a wait that fails), and the killed one.
        self.workers: dict[str, DilocoWorker] = {}
        self.killed: set[str] = set()
        #: When a worker last finished an inner step (and which), and when anything last
        #: moved: a step, an applied round, a worker's state change.
        self.last_step: dict[str, tuple[float, int]] = {}
        self.last_progress = time.monotonic()
        self.coordinator_thread: CoordinatorThread | None = None
        self.losses: dict[int, list[float]] = {}
        self.samplers = worker_samplers(corpus, cfg.workers, self.s, cfg.seed)
        self.net = InprocNetwork()
        collective = cfg.data_plane == "collective"
        # Collective: every collective is bounded below the heartbeat timeout (SPEC.md C7); worker
        # threads share 2 cores here, so the demo gives them a few seconds rather than a fraction.
        heartbeat_timeout_s = max(cfg.heartbeat_timeout_s, COLLECTIVE_HEARTBEAT_S) if collective \
            else cfg.heartbeat_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        fsm = FSMConfig(min_workers=cfg.workers if cfg.faults else 1, heartbeat_timeout_s=heartbeat_timeout_s,
                        data_plane=cfg.data_plane, reduce_timeout_s=heartbeat_timeout_s * 4 / 3)
        self.coordinator = Coordinator(
            CoordinatorConfig(fsm, OuterConfig("nesterov", cfg.outer_lr, cfg.outer_momentum),
                              collective_timeout_s=heartbeat_timeout_s / 3),
            now_s=time.monotonic(), observer=self._observe)
        self.store_host = None
        if collective:
            from diloco.collective.store import StoreHost

            self.store_host = StoreHost()
            self.coordinator.collective.store_port = self.store_host.port

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, text: str) -> None:
        self.events.append((self.now(), text))
        self.ui.note(f"[{self.now():6.1f}s] {text}")

    # Called from the coordinator thread after each event it handles.
    def _observe(self, what: str, now_s: float, info: dict) -> None:
        try:
            self._observe_event(what, info)
        except Exception as exc:  # the demo's bookkeeping must never stop the coordinator's loop
            self.errors.append((f"recording the coordinator's {what!r} event", exc))

    def _observe_event(self, what: str, info: dict) -> None:
        with self.lock:
            t = self.now()  # under the lock: each worker's recorded times never go backwards
            self.last_progress = time.monotonic()
            if what == "apply":
                self.rounds_applied += 1
                self.recorder.applied_round(t, info["fragment_id"], info["round_id"])
                self.round_params.append((info["round_id"], self._committed_params(info)))
            elif what == "quorum":
                self.below = info["below_min_workers"]
                if self.rounds_applied >= self.target_rounds:
                    return  # the run is over; workers leaving is not a pause
                self.recorder.quorum_changed(t, self.below)
                if self.below and self.rounds_applied:
                    self.below_event.set()
                    self.log(f"quorum lost: {info['reason']}")
                elif not self.below and self.rounds_applied:
                    self.log(f"quorum back: {info['reason']}")
            elif what == "dead":
                self.recorder.set_state(info["worker_id"], WorkerState.DEAD, t)
                self.log(f"{info['worker_id']} declared dead (no heartbeat for "
                         f"{self.heartbeat_timeout_s:g}s)")
            elif what == "join" and self.rounds_applied:
                self.log(f"{info['worker_id']} joined; enlisted in the open round")

    def _bytes_moved(self, status: dict) -> int:
        """Tensor bytes on the wire: through the coordinator (hub), or among the workers (collective:
        what each member's reduces and heals sent, by the algorithms' own counts)."""
        if self.store_host is None:
            return status["bytes_received"] + status["bytes_sent"]
        return sum(w.data_plane.stats["bytes_sent"] for w in self.workers.values())

    def _committed_params(self, info: dict) -> dict[str, torch.Tensor]:
        """The params the round just committed: the hub's, or (collective) a contributor's proposal,
        which is what every contributor adopts (it waits for this very commit before it changes)."""
        if self.coordinator.store is not None:
            return {n: p.detach().clone() for n, p in self.coordinator.store.params.items()}
        for wid in info["contributors"]:
            replica = self.workers[wid].data_plane.replica if wid in self.workers else None
            if replica is not None:
                return {n: p.detach().clone() for n, p in replica.params.items()}
        raise RuntimeError(f"round {info['round_id']} committed, but no contributor's replica is at hand")

    def _on_state(self, worker_id: str, state: str, _t: float) -> None:
        mapped = WorkerState(state)  # the worker's vocabulary is the timeline's
        with self.lock:
            if worker_id in self.killed:
                return
            # (A live worker the coordinator declared dead -- silent too long on a loaded
            # machine -- joins again, and its moves count again.)
            self.recorder.set_state(worker_id, mapped, self.now())
            self.last_progress = time.monotonic()

    def worker(self, index: int, worker_id: str, kill: threading.Event | None) -> None:
        try:
            self._train(index, worker_id, kill)
        except BaseException as exc:  # reported by run(); a demo must not hang on a dead thread
            self.errors.append((worker_id, exc))

    def _train(self, index: int, worker_id: str, kill: threading.Event | None) -> None:
        s = self.s
        model = build_model(s.model, derive_seed(self.cfg.seed, "model"))
        opt, sched = inner_optimizer(model, s, self.cfg.steps)
        endpoint = self.net.connect(worker_id)
        w = DilocoWorker(model, opt, endpoint, worker_id=worker_id, sync_every=self.cfg.sync_every,
                         on_state=self._on_state, coordinator_timeout_s=30.0)
        self.workers[worker_id] = w
        w.join()
        if w.stopped:
            raise RuntimeError(f"{worker_id}: could not join the demo's coordinator ({w.stop_reason})")
        start_round = w.round_ids[0]
        # A replacement continues the schedule: it trains the rounds that remain.
        steps = (self.target_rounds - start_round) * self.cfg.sync_every
        # Advance the lr schedule to where the run is, so the replacement matches its peers.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
            for _ in range(start_round * self.cfg.sync_every):
                sched.step()
        sampler = self.samplers[index]
        name = f"DiLoCo {worker_id}"
        self.ui.phase(name, steps)
        for step in range(1, steps + 1):
            if kill is not None and step == self.kill_step:
                endpoint.close()  # a crash: no goodbye, heartbeats just stop
                with self.lock:
                    self.killed.add(worker_id)
                    self.recorder.set_state(worker_id, WorkerState.DEAD, self.now())
                self.log(f"{worker_id} killed before its step {step}, mid-round "
                         f"(crash: no Leave, its heartbeats stop; min_workers={self.cfg.workers}, "
                         f"so the run must pause)")
                self.ui.finish(name, "killed")
                kill.set()
                return
            loss = inner_step(model, opt, sched, sampler, s)
            self.losses.setdefault(step + start_round * self.cfg.sync_every, []).append(loss)
            self.ui.advance(name, step, loss)
            self.last_step[worker_id] = (time.monotonic(), step)
            self.last_progress = time.monotonic()
            if not w.step_done():
                break
        w.leave()
        with self.lock:
            self.recorder.set_state(worker_id, WorkerState.STOPPED, self.now())

    def run(self) -> tuple[BaselineResult, float, int]:
        cfg = self.cfg
        thread = CoordinatorThread(self.net.coordinator(), self.coordinator, tick_interval_s=0.02)
        self.coordinator_thread = thread
        thread.start()
        try:
            kill = threading.Event()
            victim = cfg.workers - 1
            threads = []
            for i in range(cfg.workers):
                wid = f"worker-{i + 1}"
                t = threading.Thread(target=self.worker, args=(i, wid, kill if cfg.faults and i == victim else None),
                                     name=wid, daemon=True)
                t.start()
                threads.append(t)
            if cfg.faults:
                self._inject_fault(kill, victim, threads)
            self._wait("the workers to finish their inner steps",
                       lambda: not any(t.is_alive() for t in threads),
                       lambda: [t.name for t in threads if t.is_alive()], stall=True)
        except BaseException:
            for w in list(self.workers.values()):
                w.request_stop()  # their threads end at their next turn
            raise
        finally:
            self._shutdown(thread)
        self._raise_errors()
        status = self.coordinator.status()
        wall = self.now()
        timeline = self.recorder.finish(wall)
        self.timeline = timeline
        return self._result(status, wall), status["paused_s"], self._bytes_moved(status)

    def _inject_fault(self, kill: threading.Event, victim: int, threads: list[threading.Thread]) -> None:
        cfg = self.cfg
        everyone = [f"worker-{i + 1}" for i in range(cfg.workers)]
        self._wait(f"worker-{victim + 1} to crash before its step {self.kill_step}", kill.is_set,
                   lambda: everyone, stall=True)
        survivors = [w for w in everyone if w != f"worker-{victim + 1}"]
        self._wait(f"the coordinator to notice that worker-{victim + 1} is gone", self.below_event.is_set,
                   lambda: everyone, limit_s=self.heartbeat_timeout_s * 10 + 30)
        # Let the survivors reach their sync point and sit there paused (R10), so the
        # pause is visible, then keep it a little longer before the replacement comes.
        self._wait("the survivors to report PAUSED at their sync point",
                   lambda: self._all_in(survivors, WorkerState.PAUSED),
                   lambda: [w for w in survivors if self._recorded(w) is not WorkerState.PAUSED],
                   limit_s=cfg.stall_timeout_s, report_every_s=PROGRESS_EVERY_S)
        self.log(f"{', '.join(survivors)} paused at their sync point: below quorum nothing is applied")
        time.sleep(cfg.replacement_delay_s)
        wid = f"worker-{cfg.workers + 1}"
        self.log(f"starting replacement {wid}")
        t = threading.Thread(target=self.worker, args=(victim, wid, None), name=wid, daemon=True)
        t.start()
        threads.append(t)

    # ------------------------------------------------------------------ bounded waits

    def _wait(self, what: str, done, who, *, limit_s: float | None = None, stall: bool = False,
              report_every_s: float | None = None) -> None:
        """Wait until ``done()``, at most ``limit_s`` (or, with ``stall``, ``stall_timeout_s``
        without progress); a failure names ``what`` and where the workers ``who()`` are."""
        wait_until(what, done, where=lambda: self._where(who()), check=self._raise_errors,
                   last_progress=lambda: self.last_progress, note=self.log, error=DemoError,
                   limit_s=limit_s, stall_s=self.cfg.stall_timeout_s if stall else None,
                   report_every_s=report_every_s)

    def _raise_errors(self) -> None:
        if self.errors:
            where, exc = self.errors[0]
            raise DemoError(f"{where} failed: {exc!r}") from exc
        thread = self.coordinator_thread
        if thread is not None and thread.error is not None:
            raise DemoError(f"the coordinator's loop failed: {thread.error!r}") from thread.error

    def _recorded(self, worker_id: str) -> WorkerState | None:
        with self.lock:
            return self.recorder.state_of(worker_id)

    def _all_in(self, worker_ids: list[str], state: WorkerState) -> bool:
        return all(self._recorded(w) is state for w in worker_ids)

    def _where(self, worker_ids: list[str]) -> str:
        now = time.monotonic()
        return "; ".join(describe_worker(w, self._recorded(w), None if w in self.killed else self.workers.get(w),
                                         self.last_step.get(w), now) for w in worker_ids) or "no worker is late"

    def _shutdown(self, thread: CoordinatorThread) -> None:
        admin = self.net.connect("demo-admin")
        admin.send(AdminRequest("shutdown", {"kind": "drain"}))
        admin.recv(5.0)
        admin.close()
        thread.stop(5.0)
        if thread.is_alive():
            self.log("the coordinator did not stop within 5 s (left running in the background)")

    def _result(self, status: dict, wall: float) -> BaselineResult:
        cfg, s = self.cfg, self.s
        model = build_model(s.model, derive_seed(cfg.seed, "model"))
        eval_steps, eval_losses = [0], [evaluate_loss(model, self.corpus.eval, batch_size=s.eval_batch_size,
                                                       num_batches=s.eval_batches)]
        final = None
        for round_id, params in self.round_params:
            step = (round_id + 1) * cfg.sync_every
            model.load_state_dict(params, strict=False)
            if step % s.eval_every == 0 or round_id == self.round_params[-1][0]:
                eval_steps.append(step)
                eval_losses.append(evaluate_loss(model, self.corpus.eval, batch_size=s.eval_batch_size,
                                                 num_batches=s.eval_batches))
            final = params
        steps = sorted(self.losses)
        return BaselineResult(
            name="diloco", label=f"DiLoCo k={cfg.workers} H={cfg.sync_every}", steps=steps,
            train_losses=[sum(v) / len(v) for _, v in sorted(self.losses.items())],
            eval_steps=eval_steps, eval_losses=eval_losses, final_eval_loss=eval_losses[-1],
            syncs=status["rounds_applied"], bytes_moved=self._bytes_moved(status),
            k=cfg.workers, H=cfg.sync_every, num_params=status["num_params"], wall_s=wall,
            config=dict(dataclasses.asdict(cfg), settings=s.to_dict(), data=str(cfg.data) if cfg.data else None),
            final_state=final or {},
        )


def run_demo(cfg: DemoConfig, ui: DemoUI) -> DemoResult:
    corpus = Corpus.from_file(cfg.data) if cfg.data is not None else Corpus.from_stdlib()
    # One intra-op thread: k worker threads already share the cores, and for these
    # small matrices torch's thread pool costs far more than it gains (measured
    # 5-10x slower per step with 2 threads on 2 cores).
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = _Run(cfg, corpus, ui)
        diloco, paused_s, moved = run.run()
        baseline = single = None
        if cfg.baselines:
            baseline, single = _run_baselines(cfg, corpus, ui)
    finally:
        torch.set_num_threads(threads_before)
    return DemoResult(cfg, diloco, baseline, single, paused_s, moved, run.timeline, run.events)


def _run_baselines(cfg: DemoConfig, corpus: Corpus, ui: DemoUI) -> tuple[BaselineResult, BaselineResult]:
    """Synchronous data parallel and the single worker, side by side on two threads.

    Each is deterministic on its own (own model, optimizer and samplers), so running
    them at once changes nothing but the wall time: the single worker's steps fill the
    second core while data parallel's k-times larger steps occupy the first.
    """
    results: dict[str, BaselineResult] = {}
    errors: list[tuple[str, BaseException]] = []

    def train(name: str, fn, *args) -> None:
        try:
            results[name] = fn(*args, settings=cfg.settings, corpus=corpus, seed=cfg.seed,
                               progress=lambda st, tot, loss: ui.advance(name, st, loss))
        except BaseException as exc:  # re-raised below, on the demo's thread
            errors.append((name, exc))

    jobs = (("sync data parallel", train_sync_data_parallel, cfg.workers, cfg.steps),
            ("single worker", train_single_worker, cfg.steps))
    threads = []
    for name, fn, *args in jobs:
        ui.phase(name, cfg.steps)
        threads.append(threading.Thread(target=train, args=(name, fn, *args), name=name, daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    if errors:
        name, exc = errors[0]
        raise DemoError(f"the {name} baseline failed: {exc!r}") from exc
    return results["sync data parallel"], results["single worker"]


def baseline_bytes(result: BaselineResult) -> int:
    return result.syncs * comm_bytes_per_sync(result.k, result.num_params * 4)


__all__ = ["DemoConfig", "DemoError", "DemoResult", "DemoUI", "run_demo", "param_bytes"]
