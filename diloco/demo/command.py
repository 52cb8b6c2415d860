"""``diloco demo``: the terminal side (progress bars, the table, the PNG, the RESULT line)."""

from __future__ import annotations

import argparse
import pathlib
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch, matplotlib and rich load when the demo runs, not to build `diloco --help`
    from rich.console import Console

    from diloco.demo.run import DemoResult

DESCRIPTION = """\
Train a small character-level transformer with DiLoCo on text found on this
machine (default: the Python standard library's own .py sources), with k
worker threads talking to a real coordinator over the in-process transport.

By default one worker is killed mid-run with min_workers = k: the run pauses
below quorum (no outer step is applied with fewer than min_workers
contributors), a replacement joins the open round, and the run resumes.
Then fully synchronous data parallel and a single worker train for the same
number of inner steps, for comparison. Nothing is downloaded.

Prints a table, writes DIR/demo.png (loss curves and a membership timeline)
and DIR/demo.json, and ends with a RESULT line. About 2 minutes on 2 idle cores
with the defaults.

The defaults (1200 steps of 8 sequences of 64 characters, inner lr 1e-3,
H = 10, outer lr 0.7, momentum 0.8) come from sweeps of these settings
(benchmarks/bench_demo.py and bench_training.py --outer-sweep; the tables are
in benchmarks/README.md): among those that fit in three minutes, they show
DiLoCo ending clearly ahead of one worker and level with synchronous data
parallel.
"""

#: The demo's defaults (see DESCRIPTION and benchmarks/README.md, "bench_demo").
DEFAULT_STEPS = 1200
DEFAULT_BATCH = 8
DEFAULT_SEQ_LEN = 64
DEFAULT_LR = 1e-3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="a real DiLoCo run with a fault, against sync data parallel and one worker",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", "-k", type=int, default=4, metavar="K", help="workers k (default 4)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help=f"inner steps per worker and per baseline (default {DEFAULT_STEPS})")
    p.add_argument("--sync-every", "-H", type=int, default=10, metavar="H",
                   help="inner steps per outer round (default 10)")
    p.add_argument("--outer-lr", type=float, default=0.7, metavar="X", help="outer Nesterov learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.8, metavar="X", help="outer Nesterov momentum (default 0.8)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, metavar="B",
                   help=f"sequences per worker per inner step (default {DEFAULT_BATCH})")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, metavar="L",
                   help=f"characters per sequence, the model's context (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, metavar="X",
                   help=f"peak inner AdamW learning rate, cosine schedule (default {DEFAULT_LR:g})")
    p.add_argument("--data", type=pathlib.Path, metavar="PATH",
                   help="train on this text file instead of the standard library's sources")
    p.add_argument("--no-faults", dest="faults", action="store_false",
                   help="do not kill a worker (min_workers = 1)")
    p.add_argument("--no-baselines", dest="baselines", action="store_false",
                   help="skip sync data parallel and the single worker")
    p.add_argument("--data-plane", choices=("hub", "collective"), default="hub",
                   help="hub (default): pseudo-gradients go through the coordinator; collective: the "
                        "workers all-reduce among themselves (gloo, on loopback) and the coordinator only "
                        "orders and commits each round (see `diloco server --help`). Same run, same loss")
    p.add_argument("--seed", type=int, default=0, help="seed for init, shards and batches (default 0)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("demo-out"), metavar="DIR",
                   help="where to write demo.png and demo.json (default ./demo-out)")
    p.set_defaults(handler=main)


class _RichUI:
    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.progress = Progress(
            TextColumn("{task.description:<22}"), BarColumn(bar_width=30), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:>6}"), TimeElapsedColumn(),
            console=console, transient=False,
        )
        self.tasks: dict[str, int] = {}
        self.lock = threading.Lock()

    def phase(self, name: str, total: int) -> None:
        with self.lock:
            self.tasks[name] = self.progress.add_task(name, total=total, loss="-")

    def advance(self, name: str, step: int, loss: float) -> None:
        task = self.tasks.get(name)
        if task is not None:
            self.progress.update(task, completed=step, loss=f"{loss:.3f}")

    def finish(self, name: str, text: str) -> None:
        task = self.tasks.get(name)
        if task is not None:
            self.progress.update(task, description=f"{name} ({text})")
            self.progress.stop_task(task)

    def note(self, text: str) -> None:
        self.progress.console.print(f"  [bold]{text}[/bold]" if "killed" in text or "quorum" in text else f"  {text}")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from diloco.baselines import TrainSettings
    from diloco.models import ModelConfig
    from diloco.exits import UsageError
    from diloco.data import CorpusError
    from diloco.demo.run import DemoConfig, DemoError, run_demo

    console = Console(stderr=False, highlight=False)
    try:
        # About 15 held-out evaluations per curve, at round boundaries.
        eval_every = max(args.sync_every, (args.steps // 15) // max(1, args.sync_every) * args.sync_every)
        settings = TrainSettings(batch_size=args.batch_size, lr=args.lr, eval_every=eval_every,
                                 model=ModelConfig(seq_len=args.seq_len))
        cfg = DemoConfig(workers=args.workers, steps=args.steps, sync_every=args.sync_every,
                         outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, faults=args.faults,
                         baselines=args.baselines, seed=args.seed, data=args.data, settings=settings,
                         data_plane=args.data_plane)
    except (DemoError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if args.data is not None and not args.data.is_file():
        raise UsageError(f"--data {args.data}: no such file")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {args.out}: cannot create the directory ({exc.strerror})") from None
    console.print(f"[bold]diloco demo[/bold]: k={cfg.workers} workers, H={cfg.sync_every}, "
                  f"{cfg.steps} inner steps each, faults {'on' if cfg.faults else 'off'}, "
                  f"data plane {cfg.data_plane}, "
                  f"data: {cfg.data or 'Python standard library sources'}")
    ui = _RichUI(console)
    try:
        with ui.progress:
            result = run_demo(cfg, ui)
    except CorpusError as exc:
        raise UsageError(str(exc)) from None
    except DemoError as exc:
        print(f"diloco demo: error: {exc}", file=sys.stderr)
        return 1
    _report(console, result, args.out)
    return 0


def _report(console: Console, r: DemoResult, out: pathlib.Path) -> None:
    from rich.table import Table

    from diloco.demo.run import baseline_bytes
    from diloco.plots.demo import plot_demo_figure

    table = Table(title="DiLoCo demo: held-out loss (nats/char, lower is better)")
    for col in ("method", "eval loss", "syncs", "bytes moved", "wall s"):
        table.add_column(col, justify="left" if col == "method" else "right")
    rows = [(r.diloco, r.diloco.bytes_moved)]
    if r.baseline is not None:
        rows.append((r.baseline, baseline_bytes(r.baseline)))
    if r.single is not None:
        rows.append((r.single, 0))
    for res, moved in rows:
        table.add_row(res.label, f"{res.final_eval_loss:.3f}", str(res.syncs), _fmt_bytes(moved), f"{res.wall_s:.1f}")
    console.print(table)
    console.print(f"paused below quorum: {r.paused_s:.1f} s   "
                  f"outer rounds applied: {r.diloco.syncs}   params: {r.diloco.num_params:,}")
    if r.baseline is not None:
        ratio = r.diloco.final_eval_loss / r.baseline.final_eval_loss
        console.print(f"DiLoCo / sync data parallel eval loss: {ratio:.3f} with "
                      f"{r.baseline.syncs / max(1, r.diloco.syncs):.0f}x fewer syncs")
    curves = {res.label: (res.eval_steps, res.eval_losses) for res, _ in rows}
    png = plot_demo_figure(curves, r.timeline, out / "demo.png",
                           title=f"diloco demo: k={r.config.workers}, H={r.config.sync_every}",
                           ylabel="held-out loss (nats / char)")
    import json

    (out / "demo.json").write_text(json.dumps({
        "diloco": r.diloco.to_dict(),
        "baseline": r.baseline.to_dict() if r.baseline else None,
        "single": r.single.to_dict() if r.single else None,
        "paused_s": r.paused_s,
        "events": r.events,
    }, indent=1, default=str))
    console.print(f"wrote {png} and {out / 'demo.json'}")
    base = f"{r.baseline.final_eval_loss:.4f}" if r.baseline else "nan"
    single = f"{r.single.final_eval_loss:.4f}" if r.single else "nan"
    base_syncs = r.baseline.syncs if r.baseline else 0
    print(f"RESULT demo diloco_loss={r.diloco.final_eval_loss:.4f} baseline_loss={base} single_loss={single} "
          f"syncs={r.diloco.syncs} baseline_syncs={base_syncs} paused_s={r.paused_s:.1f}")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
