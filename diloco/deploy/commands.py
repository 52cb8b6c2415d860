"""CLI commands for ZeroMQ deployments: server, worker, status, shutdown, set-min-workers, kick.

Exit codes follow ``diloco.exits``: 0 ok; 1 the command ran and the
coordinator refused it (or a worker failed); 2 bad usage or input; 3 the
coordinator did not answer within ``--timeout``; 130 interrupted.

About 590 lines, most of them ``register``: every flag with its help text,
which reads best as one list in the order ``--help`` shows it. The server
and the worker themselves are ``server.py`` and ``worker_main.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from diloco.argtypes import flag_value
from diloco.deploy.options import DEFAULT_GRACE_CEILING_S, DEFAULT_HEAL_SOURCES, DEFAULT_WIRE_DTYPE, WIRE_DTYPES, client_auth
from diloco.exits import EXIT_AUTH_REFUSED, EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE, UsageError

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"


_positive_int = flag_value(int, lambda v: v >= 1, ">= 1")
_grace_seconds = flag_value(float, lambda v: 0 <= v < float("inf"), "a finite number of seconds >= 0 or auto",
                            "--grace-window")
_grace_max = flag_value(float, lambda v: 0 < v < float("inf"), "a finite number of seconds > 0", "--grace-window-max")


def _grace_window(text: str):
    """``--grace-window``: seconds, or ``auto`` (each window's length from the arrivals)."""
    return "auto" if text.strip().lower() == "auto" else _grace_seconds(text)


def momentum_decay(text: str) -> tuple[int, int, float]:
    """``--outer-momentum-decay START:ROUNDS[:FINAL]`` -> (start, rounds, final)."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        start, rounds = int(parts[0]), int(parts[1])
        final = float(parts[2]) if len(parts) == 3 else 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:ROUNDS[:FINAL] (outer steps, steps, a momentum), "
                                         f"got {text!r}") from None
    if start < 0 or rounds < 0 or not 0 <= final < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: START and ROUNDS must be >= 0 and FINAL in [0, 1)")
    return start, rounds, final


def _full_every(text: str) -> int:
    """``--full-checkpoint-every``: a positive number of rounds, or ``auto`` (0)."""
    if text.strip().lower() == "auto":
        return 0
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of rounds >= 1 or 'auto'") from None


_non_negative_int = flag_value(int, lambda v: v >= 0, ">= 0")
_positive_float = flag_value(float, lambda v: 0 < v < float("inf"), "a finite number > 0")
#: ``--overlap-alpha``: 0 <= A < 1.
_overlap_alpha = flag_value(float, lambda v: 0 <= v < 1, "in [0, 1): the weight of the local params at a merge")
#: ``--max-update-norm``: a finite number > 0, or 0 for no limit.
_outlier_factor = flag_value(float, lambda v: v == 0 or 2 <= v < float("inf"), "0 (off) or a number >= 2")
_update_norm = flag_value(float, lambda v: 0 <= v < float("inf"), "a finite number > 0 (or 0 for no limit)")


def _add_client_keys(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--key", default=None, metavar="FILE.key_secret",
                   help=f"this client's secret key, for a coordinator run with --auth (its public key must be in "
                        f"the server's {role}s/ folder); default: $DILOCO_KEY")
    p.add_argument("--server-key", default=None, metavar="FILE.key",
                   help="the coordinator's public key (server.key); default: $DILOCO_SERVER_KEY")


LINK_TIMEOUT_HELP = ("seconds a connection to the coordinator may go without delivering one whole frame before "
                     "it is closed and re-opened (tensors travel in 16 MiB frames, and a frame counts only once it "
                     "has arrived): default 30, enough for links of about 4.5 Mbit/s per worker stream; raise it "
                     "on slower links, or a big upload on a shared link is cut and retried forever")


def _add_connect(p: argparse.ArgumentParser, role: str = "admin") -> None:
    p.add_argument("--connect", default=DEFAULT_ADDRESS, metavar="ADDR",
                   help=f"the coordinator's address, as given to `diloco server --bind` (default {DEFAULT_ADDRESS})")
    p.add_argument("--timeout", type=_positive_float, default=5.0, metavar="S",
                   help="give up after S seconds without an answer: exit code 3 (default 5)")
    _add_client_keys(p, role)


def _is_loopback_bind(address: str) -> bool:
    """True for ipc:// and for tcp:// on a loopback address (127.0.0.0/8, ::1, localhost)."""
    from diloco.transport.zmq.address import is_loopback_address

    return is_loopback_address(address)


def register(subparsers) -> None:
    fmt = argparse.RawDescriptionHelpFormatter

    # ------------------------------------------------------------- server
    p = subparsers.add_parser(
        "server", formatter_class=fmt,
        help="run the coordinator: workers connect to it over ZeroMQ",
        description="Run the coordinator of one DiLoCo run on a ZeroMQ ROUTER socket.\n\n"
                    "Workers (`diloco worker --connect ADDR`) join it; it averages their pseudo-gradients\n"
                    "and applies an outer step per round, but never with fewer than --min-workers\n"
                    "contributors: below that the run pauses until a replacement joins or the quorum is\n"
                    "lowered (`diloco set-min-workers`). A worker silent for --heartbeat-timeout seconds\n"
                    "is declared dead. Prints one line per join, death, quorum change and applied round.\n"
                    "With --checkpoint-dir DIR every applied round is made durable in DIR (safetensors\n"
                    "checkpoints, the newest --keep kept, and for a big model a journal of each round's\n"
                    "mean pseudo-gradient) before any worker hears of it, with an audit log DIR/events.jsonl;\n"
                    "`diloco server --resume DIR` continues that run after a crash or `shutdown --save`\n"
                    "(workers re-join). A supervisor can always pass both: --checkpoint-dir DIR --resume DIR.",
        epilog="example:\n  diloco server --bind tcp://127.0.0.1:5555 --min-workers 3 --heartbeat-timeout 5 "
               "--checkpoint-dir ckpt/server")
    p.add_argument("--bind", default=DEFAULT_ADDRESS, metavar="tcp://HOST:PORT",
                   help=f"address to listen on; port 0 picks a free port (printed) (default {DEFAULT_ADDRESS})")
    p.add_argument("--min-workers", type=_positive_int, default=None, metavar="N",
                   help="the quorum: no outer step with fewer contributors (default 1; on --resume: the saved value)")
    p.add_argument("--heartbeat-timeout", type=_positive_float, default=None, metavar="S",
                   help="seconds of silence after which a worker is declared dead; workers heartbeat every S/4 "
                        "(default 30)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="make every applied round durable before announcing it: DIR/coordinator-<rounds>"
                        ".safetensors (params, outer optimizer, round counters) and DIR/events.jsonl (audit log); "
                        "also where `shutdown --save` writes (without it, nothing is saved)")
    p.add_argument("--keep", type=_positive_int, default=3, metavar="K",
                   help="checkpoint files kept in --checkpoint-dir, newest first (default 3)")
    p.add_argument("--full-checkpoint-every", type=_full_every, default="auto", metavar="N|auto",
                   help="write a full checkpoint (params and outer momentum) every N applied rounds, in the "
                        "background, and in between journal what each round is made of in --checkpoint-dir "
                        "(each contribution as it arrives; on an fp32 run the round's mean), committed before "
                        "the round is announced; --resume replays the journal bit for bit. 1: a full "
                        "checkpoint every round. auto: 1 when a full checkpoint is under 128 MB, else 8 "
                        "(default auto)")
    p.add_argument("--mode", choices=("sync", "async"), default=None,
                   help="sync: rounds with a barrier (DiLoCo); async: one outer step per contribution "
                        "(Async Local-SGD) (default sync)")
    p.add_argument("--grace-window", type=_grace_window, default=None, metavar="S",
                   help="async mode: contributions that arrive within S seconds of the first pending one are "
                        "merged into one outer step (their mean, as a sync round's); the window closes early when "
                        "every live worker has submitted, and at once when a worker leaves or dies. The quorum "
                        "(--min-workers) holds for the merged step. Fast workers wait up to S at their sync point. "
                        "At most the heartbeat timeout. 0: one outer step per contribution (default 0; on "
                        "--resume: the saved value). auto: each window as long as the recent arrivals say (their "
                        "median offset after a window opens plus 3 median absolute deviations, recomputed at "
                        "every close), starting at and never above --grace-window-max")
    p.add_argument("--grace-window-max", type=_grace_max, default=None, metavar="S",
                   help=f"--grace-window auto: the longest window, where it starts (default "
                        f"{DEFAULT_GRACE_CEILING_S:g} s, at most the heartbeat timeout)")
    p.add_argument("--fragments", type=_positive_int, default=None, metavar="F",
                   help="Streaming DiLoCo: split the params into F fragments that sync separately (default 1)")
    p.add_argument("--outer-optimizer", choices=("nesterov", "sgd", "adam", "delayed_nesterov"), default=None,
                   help="outer optimizer (default nesterov; delayed_nesterov in async mode)")
    p.add_argument("--outer-lr", type=_positive_float, default=None, metavar="X", help="outer learning rate (default 0.7: the best at H = 10 in "
                        "benchmarks/bench_training.py --outer-sweep; at H = 50 1.0 did 0.8-2.5%% better, "
                        "so with H >= 50 try 1.0; 3 with --wire-dtype sparse, whose step has no momentum)")
    p.add_argument("--outer-momentum", type=float, default=None, metavar="X",
                   help="outer momentum (default 0.8: better than the DiLoCo paper's 0.9 by 1.3-3.2%% in held-out "
                        "loss at H = 10 and 50, two seeds, in that sweep)")
    p.add_argument("--outer-momentum-warmup", type=_non_negative_int, default=None, metavar="ROUNDS",
                   help="momentum warm-up (Pier): the outer momentum rises linearly over the first ROUNDS outer "
                        "steps of each fragment to --outer-momentum (default 0: none)")
    p.add_argument("--outer-momentum-decay", type=momentum_decay, default=None, metavar="START:ROUNDS[:FINAL]",
                   help="momentum decay (Pier): from outer step START the outer momentum falls linearly to FINAL "
                        "(default 0) over ROUNDS steps, then stays there; 0:0 turns a saved one off")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run of the newest valid checkpoint in DIR (same params, outer optimizer "
                        "state and round counters; a corrupt newest file falls back to the previous one with a "
                        "warning; an empty or missing DIR starts a fresh run); options given here override the "
                        "saved ones (not --mode or --fragments)")
    p.add_argument("--max-message-mb", type=_positive_float, default=None, metavar="MB",
                   help="largest message accepted, in MiB (default 1024); checked as its parts arrive")
    p.add_argument("--link-timeout", type=_positive_float, default=None, metavar="S", help=LINK_TIMEOUT_HELP)
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default=None,
                   help=f"how workers upload pseudo-gradients and the coordinator broadcasts each sync round's "
                        f"update: fp32 (4 bytes per parameter), bf16 (2), int8 (1, plus one fp32 scale per "
                        f"256 values), int4 (0.5, plus one fp32 scale per 64; the hub plane only; use it with "
                        f"the workers' default error feedback) or sparse (SparseLoCo: the top --sparsity of each "
                        f"chunk of every worker's error-feedback accumulator, 2 bits a value: about 1/120 of fp32 "
                        f"at the default; sync mode; its outer step is plain SGD, --outer-lr default 3); the "
                        f"outer step is fp32 whatever it is, and "
                        f"coordinator and workers hold bit-identical params. Workers adopt it from the coordinator (default "
                        f"{DEFAULT_WIRE_DTYPE}; on --resume: the saved one)")
    p.add_argument("--sparsity", type=_positive_float, default=None, metavar="D",
                   help="--wire-dtype sparse: the share of each chunk sent (default 1/64 = 0.0156; 0.01 to 0.03 "
                        "is the method's range; on --resume: the saved one)")
    p.add_argument("--sparse-chunk", type=int, default=None, metavar="N",
                   help="--wire-dtype sparse: elements per chunk, 2 to 8192 (default 4096): each chunk sends its "
                        "top --sparsity entries, so every worker's payload has the same size")
    p.add_argument("--sparse-beta", type=float, default=None, metavar="B",
                   help="--wire-dtype sparse: each worker's accumulator decay, e <- B*e + delta before a Submit "
                        "(0 to 1; default 0.95)")
    p.add_argument("--merge", choices=("auto", "uniform", "tokens"), default=None,
                   help="how a round's contributions merge: uniform (their mean), tokens (weighted by the tokens "
                        "each worker trained on: diloco.Worker.step(tokens=N), else its inner steps), auto "
                        "(tokens with --dylu, where workers take different numbers of steps; else uniform). The "
                        "hub plane only (default auto; on --resume: the saved one)")
    p.add_argument("--token-budget", type=_positive_int, default=None, metavar="N",
                   help="stop the run as `shutdown --save` does once applied rounds have trained on N tokens "
                        "(what workers pass to step(tokens=...), else their inner steps); `diloco status` shows "
                        "the progress and an ETA, `diloco set-token-budget` changes it (default: none; on "
                        "--resume: the saved one)")
    p.add_argument("--data-units", type=_non_negative_int, default=None, metavar="N",
                   help="hand the data out as N work units per epoch (a fleet-wide shuffle): each worker holds one "
                        "unit per round, a unit is finished when its round applies, a dead worker's unit is handed "
                        "out again, and no unit is trained twice in an epoch; the worker's loop reads its unit "
                        "(diloco.Worker.data_unit; the built-in entry does). Hub plane, one fragment, no overlap "
                        "(default: off; on --resume: the saved run's)")
    p.add_argument("--dylu", action="store_true", default=None,
                   help="DyLU (dynamic local updates): each worker takes H_w = max(1, floor(v_w / v_max * H)) inner "
                        "steps per round, v_w its measured training speed, H --sync-every (needed with it); slower "
                        "workers sync after fewer steps instead of keeping the others waiting (on --resume: "
                        "default the saved setting)")
    p.add_argument("--sync-every", type=_positive_int, default=None, metavar="H",
                   help="with --dylu: the inner steps per round of the fastest worker (workers' own --sync-every "
                        "is replaced by their H_w)")
    p.add_argument("--max-update-norm", type=_update_norm, default=None, metavar="X",
                   help="refuse a contribution whose L2 norm (over all its tensors) exceeds X (update_too_large); "
                        "off by default. Use it when workers you do not fully trust can reach the run, or to "
                        "catch a diverging worker: set X to a few times the largest healthy pseudo-gradient "
                        "norm, which the workers' round lines or a trial run show. 0: no limit (on --resume: "
                        "default the saved limit)")
    p.add_argument("--outlier-factor", type=_outlier_factor, default=None, metavar="F",
                   help="refuse a contribution whose L2 norm is over F times the median norm of the fragment's "
                        "last 16 accepted contributions (update_too_large), before it enters a round: one worker "
                        "or key cannot wreck the params with a huge but finite pseudo-gradient, and nothing needs "
                        "tuning (before 3 are known: 1000 x the params' norm). 0: off (default 10; on --resume: "
                        "the saved value)")
    p.add_argument("--max-failed-attempts", type=_positive_int, default=None, metavar="N",
                   help="collective plane: after N failed attempts in a row at one round by the same group "
                        "(timeouts, digest mismatches, failed reduces), stop the run with a checkpoint and the "
                        "reason, rather than retry forever (default 16; on --resume: the saved value). A member "
                        "lost changes the group and starts the count again")
    p.add_argument("--data-plane", choices=("hub", "collective"), default=None,
                   help="how a round's pseudo-gradients combine. hub (default): every worker sends its "
                        "pseudo-gradient here and gets the new params back; right for a few workers, small "
                        "models, or workers that can only connect out (NAT). collective: the workers all-reduce "
                        "among themselves over torch.distributed (gloo) and each runs the outer step; this "
                        "server only orders the reduce and commits it on a unanimous digest vote of at least "
                        "--min-workers members, and never holds the model (its link carries no tensors; its "
                        "checkpoints are kilobytes). Workers must reach each other. Sync mode only "
                        "(on --resume: the saved plane)")
    p.add_argument("--collective-timeout", type=_positive_float, default=None, metavar="S",
                   help="collective plane: bound on each group creation, all-reduce and heal transfer on a "
                        "worker (default: a third of the heartbeat timeout); must be below the heartbeat "
                        "timeout. An attempt whose members have not all reported within 4x this aborts and is "
                        "retried by the survivors")
    p.add_argument("--heal-sources", type=int, default=None, metavar="K",
                   help=f"collective plane: a joiner copies the run's state from up to K members at once, each "
                        f"sending a part (default {DEFAULT_HEAL_SOURCES}; 1 to 8; fewer when fewer hold it; one for "
                        f"sharded members). A source that dies mid-heal has its part sent by the others")
    p.add_argument("--trusted-data-network", action="store_true",
                   help="collective plane: allow a non-loopback --bind. gloo traffic and the rendezvous store "
                        "are neither authenticated nor encrypted (--auth covers only the control plane): say "
                        "this only when every host that can reach the network is yours")
    p.add_argument("--auth", default=None, metavar="DIR",
                   help="authenticate and encrypt every connection (ZeroMQ CURVE): DIR/server.key_secret is the "
                        "server's key, DIR/workers/*.key the public keys allowed to train, DIR/admins/*.key those "
                        "allowed to run admin commands (see `diloco keygen --help`)")
    p.add_argument("--insecure", action="store_true",
                   help="allow binding a non-loopback address without --auth: anyone who reaches the port can "
                        "join, poison or stop the run")
    p.add_argument("--io-threads", type=_positive_int, default=None, metavar="N",
                   help="ZeroMQ I/O threads (CURVE encryption runs on them; default 1, or 2 with --auth)")
    p.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="serve a read-only live dashboard at http://HOST:PORT/, its JSON at /api/status and "
                        "Prometheus metrics at /metrics (off by default; port 0 picks a free port, printed). "
                        "Loopback only (e.g. 127.0.0.1:8080) unless --auth or --insecure is given, as for --bind. "
                        "With --auth DIR every path needs the token in DIR/http.token (made on first use, mode "
                        "0600): open /?token=TOKEN once in a browser, or send 'Authorization: Bearer TOKEN'")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="append a JSONL metrics log to DIR/metrics.jsonl: one line per applied round, per worker "
                        "metrics sample (step, steps/s, loss, samples from its heartbeats) and per membership "
                        "event; rotated past 16 MiB (4 old files kept). `diloco plot-log DIR` draws it")
    p.set_defaults(handler=cmd_server)

    # ------------------------------------------------------------- worker
    p = subparsers.add_parser(
        "worker", formatter_class=fmt,
        help="train as one worker of a run (the built-in demo model, or yours via --entry)",
        description="Train as one worker: join the coordinator at --connect, run H inner steps, send the\n"
                    "pseudo-gradient, wait for the round, continue from the new global params; repeat\n"
                    "until the coordinator stops the run. While the run is below quorum the worker idles\n"
                    "at its sync point and stays stoppable. After a coordinator restart it re-joins.\n\n"
                    "Without --entry it trains the built-in char transformer on the Python standard\n"
                    "library's own source text (tiny settings: a round takes a few seconds on 2 cores).\n"
                    "With --entry module:function it calls your function, which returns a\n"
                    "diloco.worker.TrainingSetup(model, optimizer, batches, loss_fn); the function may take\n"
                    "keyword arguments `worker_id`, `rank`, `world_size` and `device` (to pick a data shard).\n\n"
                    "Under torchrun one worker is a group of ranks (data parallel inside, gloo on CPU, NCCL on\n"
                    "GPU): rank 0 talks to the coordinator, every rank averages gradients each step and takes\n"
                    "the same params, pauses and stops at the same step; a rank that dies takes the worker\n"
                    "down as one member.",
        epilog="example:\n  diloco worker --connect tcp://127.0.0.1:5555 --id w1 --checkpoint-dir ckpt/w1\n"
               "  diloco worker --connect tcp://10.0.0.5:5555 --entry mytrain:make_setup --sync-every 100\n"
               "  torchrun --nproc-per-node 4 -m diloco worker --connect tcp://10.0.0.5:5555 --id node1 \\\n"
               "      --entry mytrain:make_setup --device auto\n\n"
               "exit codes: 0 stopped cleanly (told to stop, drained, saved, --max-steps, SIGTERM); 1 refused\n"
               "by the run or training failed; 2 bad usage or --entry; 3 coordinator unreachable: gave up\n"
               "after --coordinator-timeout, checkpoint written (with --checkpoint-dir), restart it;\n"
               "4 the coordinator refused this worker's key; 130 interrupted")
    p.add_argument("--connect", default=DEFAULT_ADDRESS, metavar="ADDR",
                   help=f"the coordinator's address (default {DEFAULT_ADDRESS})")
    p.add_argument("--link-timeout", type=_positive_float, default=None, metavar="S", help=LINK_TIMEOUT_HELP)
    p.add_argument("--id", dest="worker_id", default=None, metavar="NAME",
                   help="this worker's id, unique in the run (default: HOSTNAME-PID)")
    p.add_argument("--entry", default=None, metavar="module:function",
                   help="your training setup; default: the built-in demo (diloco.deploy.default_entry:make_setup)")
    p.add_argument("--sync-every", type=_positive_int, default=None, metavar="H",
                   help="inner steps per outer round (default 20 for the built-in demo, else 100)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="the worker's own checkpoint (its inner optimizer state and place in the run), written "
                        "on save-and-stop (and before exit 3, see --coordinator-timeout) and read when it starts "
                        "again")
    p.add_argument("--checkpoint-every", type=_positive_int, default=None, metavar="N",
                   help="with --checkpoint-dir: also write the checkpoint after every N rounds it synced (at a "
                        "commit boundary). On the collective plane the workers hold the run's params and outer "
                        "optimizer state, so this is what a whole-run `--resume` continues from")
    p.add_argument("--max-steps", type=_positive_int, default=None, metavar="N",
                   help="stop (leave the run) after N inner steps (default: train until the coordinator stops)")
    p.add_argument("--coordinator-timeout", type=_positive_float, default=None, metavar="S",
                   help="how long to wait for a coordinator that says nothing, in any phase (joining, training, "
                        "waiting for a round's Result, paused below quorum); default 600 (10 minutes). While it "
                        "waits the worker prints a line after 5 s, then every 10 s; a coordinator restarted "
                        "within S seconds is re-joined and the run goes on. At S it gives up: writes its "
                        "checkpoint (with --checkpoint-dir) and exits 3, so a supervisor restarts it")
    p.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                   help="torch CPU threads for this worker (default 1)")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where to train: auto (default) is this rank's GPU (LOCAL_RANK) when CUDA is present, "
                        "else the CPU; pseudo-gradients are copied to the CPU only for the wire")
    p.add_argument("--overlap-steps", type=_non_negative_int, default=0, metavar="T",
                   help="overlap communication with compute (Streaming DiLoCo's tau): after sending a fragment's "
                        "pseudo-gradient keep training, and merge the round's new params T inner steps later; "
                        "wait only if the round has not been applied by then (below quorum the worker still "
                        "pauses). 0 <= T < --sync-every; default 0: wait at every sync point")
    p.add_argument("--overlap-alpha", type=_overlap_alpha, default=None, metavar="A",
                   help="with --overlap-steps: the merge keeps A of the local params, local <- A*local + "
                        "(1-A)*global, for that fragment only; 0 <= A < 1 (default 0.5, as in Streaming DiLoCo)")
    p.add_argument("--error-feedback", choices=("auto", "on", "off"), default="auto",
                   help="keep what quantizing a pseudo-gradient for the wire left out and add it to the next one "
                        "(MuLoCo, SparseLoCo), so nothing is lost for good; auto (default): on when the run's "
                        "--wire-dtype is int8 or int4, off for fp32 and bf16. The residual is part of the "
                        "checkpoint")
    _add_client_keys(p, "worker")
    p.set_defaults(handler=cmd_worker)

    # ------------------------------------------------------------- status
    p = subparsers.add_parser(
        "status", formatter_class=fmt,
        help="show the run: phase, quorum and why, members with heartbeat ages, open rounds",
        description="Ask the coordinator for its status and print it: the phase (forming, running, paused,\n"
                    "draining, stopped), the quorum (live workers vs min_workers) and the reason for the\n"
                    "decision, every member with the age of its last heartbeat, each open round with who\n"
                    "contributed (parked at the barrier) and who is still awaited, and rounds applied.\n"
                    "--json prints the coordinator's status dict (keys include phase, below_min_workers,\n"
                    "min_workers, members, fragments, parked_workers, rounds_applied, quorum_reason,\n"
                    "transport).")
    _add_connect(p)
    p.add_argument("--json", action="store_true", help="print the raw status as one JSON object")
    p.add_argument("--watch", action="store_true",
                   help="refresh every --interval seconds until Ctrl-C (keeps retrying while unreachable)")
    p.add_argument("--interval", type=_positive_float, default=1.0, metavar="S", help="--watch refresh period (default 1)")
    p.set_defaults(handler=cmd_status)

    # ------------------------------------------------------------- shutdown
    p = subparsers.add_parser(
        "shutdown", formatter_class=fmt,
        help="end the run: drain (default), --save (checkpoint then stop) or --abort",
        description="End the run. Every worker, including those parked at the barrier, is told to stop and\n"
                    "exits 0.\n"
                    "  (default) drain: the round in flight applies, then the run stops; below quorum it\n"
                    "            stops at once (a paused run must always be stoppable).\n"
                    "  --save    stop now and write the coordinator's checkpoint (params, outer optimizer,\n"
                    "            round counters) before telling any worker; workers save their own state.\n"
                    "            Resume with `diloco server --resume DIR`.\n"
                    "  --abort   stop now; nothing is saved.")
    _add_connect(p)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--drain", dest="kind", action="store_const", const="drain", help="finish the round in flight (default)")
    kind.add_argument("--save", dest="kind", action="store_const", const="save_and_stop", help="checkpoint, then stop")
    kind.add_argument("--abort", dest="kind", action="store_const", const="abort", help="stop now, save nothing")
    p.set_defaults(handler=cmd_shutdown, kind="drain")

    # ------------------------------------------------------------- set-min-workers
    p = subparsers.add_parser(
        "set-min-workers", formatter_class=fmt,
        help="change the quorum at run time (lowering it can release a paused round)",
        description="Set min_workers, the quorum, while the run is going. Lowering it re-checks every\n"
                    "parked round and applies those that are complete (a paused run resumes); raising it\n"
                    "may pause the run.")
    p.add_argument("min_workers", type=_positive_int, metavar="N")
    _add_connect(p)
    p.set_defaults(handler=cmd_set_min_workers)

    # ------------------------------------------------------------- set-token-budget
    p = subparsers.add_parser(
        "set-token-budget", formatter_class=fmt,
        help="change the run's token budget at run time (or remove it: none)",
        description="Set the token budget while the run is going: once applied rounds have trained on N\n"
                    "tokens the run stops as `shutdown --save` does (at once if it already has). `none`\n"
                    "removes the budget.")
    p.add_argument("budget", type=_budget, metavar="N|none")
    _add_connect(p)
    p.set_defaults(handler=cmd_set_token_budget)

    # ------------------------------------------------------------- kick
    p = subparsers.add_parser(
        "kick", formatter_class=fmt,
        help="remove a worker from the run (--ban: and keep it out)",
        description="Remove a member now (as if it had died). Its contribution to the open round, if any,\n"
                    "still counts (SPEC.md P1); the quorum is re-checked. The worker is answered `rejoin` on\n"
                    "its next heartbeat and joins again unless you stop it, or unless --ban: then its id\n"
                    "(and, on a server run with --auth, its key) is refused at join (`banned`) until\n"
                    "`diloco unban WORKER`. --ban also works for an id that is not a member now.")
    p.add_argument("worker_id", metavar="WORKER")
    p.add_argument("--ban", action="store_true", help="keep the worker (and its key) out until `diloco unban`")
    _add_connect(p)
    p.set_defaults(handler=cmd_kick)

    # ------------------------------------------------------------- unban
    p = subparsers.add_parser(
        "unban", formatter_class=fmt,
        help="let a worker banned with `kick --ban` join again",
        description="Lift a ban made with `diloco kick WORKER --ban`: the worker id, and the key it joined\n"
                    "with (on a server run with --auth), may join again. `diloco status` lists the bans.")
    p.add_argument("worker_id", metavar="WORKER")
    _add_connect(p)
    p.set_defaults(handler=cmd_unban)

    # ------------------------------------------------------------- keygen
    p = subparsers.add_parser(
        "keygen", formatter_class=fmt,
        help="make a CURVE key pair for `diloco server --auth` and its clients",
        description="Write DIR/NAME.key (the public key: hand it out) and DIR/NAME.key_secret (the secret\n"
                    "key, mode 0600: keep it; diloco refuses a secret key file readable by group or others).\n"
                    "Existing files are never overwritten.\n\n"
                    "A server's auth directory (`diloco server --auth DIR`) holds:\n"
                    "  DIR/server.key_secret   the server's key pair (its server.key goes to every client)\n"
                    "  DIR/workers/*.key       public keys allowed to train\n"
                    "  DIR/admins/*.key        public keys allowed to run admin commands\n"
                    "Clients pass --key NAME.key_secret --server-key server.key (or set DILOCO_KEY and\n"
                    "DILOCO_SERVER_KEY).",
        epilog="example (three commands):\n"
               "  diloco keygen server --out auth\n"
               "  diloco keygen w1 --out keys && mkdir -p auth/workers && cp keys/w1.key auth/workers/\n"
               "  diloco keygen ops --out keys && mkdir -p auth/admins && cp keys/ops.key auth/admins/\n"
               "then:\n"
               "  diloco server --bind tcp://0.0.0.0:5555 --auth auth\n"
               "  diloco worker --connect tcp://HOST:5555 --key keys/w1.key_secret --server-key auth/server.key\n"
               "  diloco status --connect tcp://HOST:5555 --key keys/ops.key_secret --server-key auth/server.key")
    p.add_argument("name", metavar="NAME", help="the key's name: the files are NAME.key and NAME.key_secret")
    p.add_argument("--out", default=".", metavar="DIR", help="where to write them (created if missing; default .)")
    p.set_defaults(handler=cmd_keygen)


# ------------------------------------------------------------------ handlers

def cmd_server(args) -> int:
    from diloco.deploy.server import ServerError, ServerSettings, run_server
    from diloco.deploy.tuning import keep_freed_memory

    keep_freed_memory()
    settings = ServerSettings(
        bind=args.bind, min_workers=args.min_workers, heartbeat_timeout_s=args.heartbeat_timeout,
        checkpoint_dir=args.checkpoint_dir, mode=args.mode, fragments=args.fragments,
        grace_window_s=args.grace_window, grace_window_max_s=args.grace_window_max,
        outer_optimizer=args.outer_optimizer, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        outer_momentum_warmup=args.outer_momentum_warmup, outer_momentum_decay=args.outer_momentum_decay,
        resume=args.resume, keep=args.keep, full_checkpoint_every=args.full_checkpoint_every,
        max_message_bytes=None if args.max_message_mb is None else int(args.max_message_mb * (1 << 20)),
        link_timeout_s=args.link_timeout, max_update_norm=args.max_update_norm, wire_dtype=args.wire_dtype,
        outlier_factor=args.outlier_factor, max_failed_attempts=args.max_failed_attempts,
        dylu=args.dylu, sync_every=args.sync_every, merge=args.merge, token_budget=args.token_budget,
        data_units=args.data_units,
        auth_dir=args.auth, io_threads=args.io_threads, http=args.http, log_dir=args.log_dir,
        data_plane=args.data_plane, collective_timeout_s=args.collective_timeout, heal_sources=args.heal_sources,
        sparsity=args.sparsity, sparse_chunk=args.sparse_chunk, sparse_beta=args.sparse_beta,
        trusted_data_network=args.trusted_data_network,
    )
    if args.http is not None and args.auth is None and not args.insecure and not _is_loopback_bind(f"tcp://{args.http}"):
        raise UsageError(f"--http {args.http}: serving the dashboard beyond loopback needs --auth DIR or --insecure "
                         f"(it shows the run to anyone who reaches the port)")
    if args.auth is None and not _is_loopback_bind(args.bind):
        if not args.insecure:
            raise UsageError(f"--bind {args.bind}: listening beyond loopback needs --auth DIR (see `diloco keygen "
                             f"--help`), or --insecure to accept that anyone who reaches the port owns the run")
        print(f"WARNING: {args.bind} is reachable from the network with no authentication (--insecure): anyone "
              f"who reaches it can join, submit, or stop the run", file=sys.stderr, flush=True)
    try:
        run_server(settings)
    except ServerError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def cmd_worker(args) -> int:
    from diloco.deploy.tuning import keep_freed_memory
    from diloco.deploy.worker_main import run_worker_command

    keep_freed_memory()
    return run_worker_command(args)


def _unreachable(args, exc: Exception) -> int:
    from diloco.transport.base import AuthRefused

    if isinstance(exc, AuthRefused):
        print(f"diloco {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_AUTH_REFUSED
    print(f"diloco {args.command}: error: coordinator unreachable: {exc}", file=sys.stderr)
    return EXIT_UNREACHABLE


def _admin(args, command: str, payload: dict | None = None):
    from diloco.deploy.admin import request
    from diloco.transport.base import TransportError

    if not args.connect.startswith(("tcp://", "ipc://")):
        raise UsageError(f"--connect {args.connect!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    auth = client_auth(args)
    try:
        return request(args.connect, command, payload, timeout_s=args.timeout, auth=auth), None
    except TransportError as exc:
        return None, exc


def cmd_status(args) -> int:
    from diloco.deploy.admin import render_status

    if not args.watch:
        reply, err = _admin(args, "status")
        if err is not None:
            return _unreachable(args, err)
        text = (json.dumps(reply.data, indent=2, sort_keys=True) + "\n" if args.json
                else render_status(reply.data, args.connect))
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:  # `diloco status --json | head`: the reader left, which is fine
            sys.stdout = open(os.devnull, "w")
        return EXIT_OK
    try:
        from diloco.transport.base import AuthRefused

        while True:
            reply, err = _admin(args, "status")
            if isinstance(err, AuthRefused):  # retrying cannot help
                return _unreachable(args, err)
            if args.json:
                print(json.dumps(reply.data if err is None else {"error": str(err)}, sort_keys=True), flush=True)
            else:
                page = (render_status(reply.data, args.connect) if err is None
                        else f"coordinator unreachable: {err} (retrying)\n")
                print(f"\x1b[2J\x1b[H{time.strftime('%H:%M:%S')}\n{page}" if sys.stdout.isatty()
                      else f"--- {time.strftime('%H:%M:%S')}\n{page}", end="", flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return EXIT_OK


def _report(args, reply, err, ok_text: str) -> int:
    if err is not None:
        return _unreachable(args, err)
    if not reply.ok:
        print(f"diloco {args.command}: refused: {reply.error}", file=sys.stderr)
        return EXIT_PROBLEM
    d = reply.data
    print(f"{ok_text}: phase {d.get('phase')}, {len(d.get('members', []))} live, min_workers "
          f"{d.get('min_workers')}, rounds applied {d.get('rounds_applied')}")
    return EXIT_OK


def cmd_shutdown(args) -> int:
    reply, err = _admin(args, "shutdown", {"kind": args.kind})
    return _report(args, reply, err, f"shutdown ({args.kind}) accepted")


def cmd_set_min_workers(args) -> int:
    reply, err = _admin(args, "set_min_workers", {"min_workers": args.min_workers})
    return _report(args, reply, err, f"min_workers set to {args.min_workers}")


def cmd_set_token_budget(args) -> int:
    reply, err = _admin(args, "set_token_budget", {"budget": args.budget})
    return _report(args, reply, err, "token budget removed" if args.budget is None
                   else f"token budget set to {args.budget:,} tokens")


def _budget(text: str) -> int | None:
    """``set-token-budget N|none``."""
    return None if text.strip().lower() == "none" else _positive_int(text)


def cmd_kick(args) -> int:
    reply, err = _admin(args, "kick", {"worker_id": args.worker_id, "ban": args.ban})
    return _report(args, reply, err, f"{'kicked and banned' if args.ban else 'kicked'} {args.worker_id}")


def cmd_unban(args) -> int:
    reply, err = _admin(args, "unban", {"worker_id": args.worker_id})
    return _report(args, reply, err, f"unbanned {args.worker_id}")


def cmd_keygen(args) -> int:
    from diloco.transport.zmq.auth import AuthError, generate_keypair

    try:
        public, secret = generate_keypair(args.name, args.out)
    except (AuthError, OSError) as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {public} (public key: copy it where it is needed) and {secret} (secret key, mode 0600: keep it)")
    return EXIT_OK


__all__ = ["register"]
