"""``diloco plot-log DIR --out run.png``: draw a server's metrics log (``diloco server --log-dir DIR``).

Light at import (``diloco --help`` stays fast): matplotlib loads in the handler.
"""

from __future__ import annotations

import argparse

from diloco.exits import EXIT_OK, UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plot-log", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="draw a server's metrics log (--log-dir) as a PNG: loss curves and the membership timeline",
        description="Read DIR/metrics.jsonl (and its rotated files), written by `diloco server --log-dir DIR`,\n"
                    "and write one PNG: every worker's reported training loss and each applied round's mean\n"
                    "contributor loss over time (top); each worker's state as the coordinator saw it --\n"
                    "training, waiting at the barrier, paused below quorum, dead -- below.",
        epilog="example:\n  diloco plot-log logs/ --out run.png")
    p.add_argument("log_dir", metavar="DIR", help="the directory given to `diloco server --log-dir`")
    p.add_argument("--out", default="run.png", metavar="FILE.png", help="where to write the PNG (default run.png)")
    p.add_argument("--title", default=None, help="the figure's title (default: the run id)")
    p.set_defaults(handler=cmd_plot_log)


def cmd_plot_log(args) -> int:
    from diloco.observe.plotlog import PlotLogError, plot_log
    from diloco.plots import PlotError, TimelineError

    try:
        path = plot_log(args.log_dir, args.out, title=args.title)
    except (PlotLogError, PlotError, TimelineError, OSError) as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {path}")
    return EXIT_OK
