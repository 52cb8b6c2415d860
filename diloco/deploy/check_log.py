"""``diloco check-log DIR``: trace validation of a run's audit log (``diloco.coordinator.tracecheck``)."""

from __future__ import annotations

import argparse

from diloco.exits import EXIT_OK, EXIT_PROBLEM


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "check-log", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="replay a run's audit log through the pure machine and check every logged decision",
        description="Trace validation. A server run with --checkpoint-dir DIR logs, in DIR/events.jsonl,\n"
                    "every event it feeds its round state machine (with its clock) and the machine's\n"
                    "answers, next to the decisions it acted on (applied rounds with their contributors,\n"
                    "deaths, discards, the stop). check-log restores the pure machine from each\n"
                    "incarnation's logged snapshot (coordinator restarts included), replays the inputs\n"
                    "and checks that every answer and every decision is exactly the machine's. Prints\n"
                    "OK with what it checked, or the first divergence with the lines before it.\n"
                    "Exit 0: no divergence; 1: a divergence, or nothing to check.",
        epilog="example:\n  diloco check-log ckpt/server")
    p.add_argument("log", metavar="DIR", help="the server's --checkpoint-dir (or its events.jsonl)")
    p.set_defaults(handler=cmd_check_log)


def cmd_check_log(args) -> int:
    from diloco.coordinator.tracecheck import check_log

    report = check_log(args.log)
    print(report.summary())
    return EXIT_OK if report.ok else EXIT_PROBLEM
