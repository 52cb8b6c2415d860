"""The ``diloco`` command. Each subcommand lives with the code it drives.

A command module exposes ``register(subparsers)``, which adds its parser and
sets ``handler`` (a callable taking the parsed args and returning an exit
code). This file only wires them together; the exit codes and ``UsageError``
live in ``diloco.exits``, which the subcommands import. The command modules
are light (they import torch, zmq and the rest inside their handlers), so
``diloco --help`` starts fast.
"""

from __future__ import annotations

import argparse
import logging
import sys

from diloco import __version__
from diloco.demo import command as demo_command
from diloco.deploy import check_log as check_log_command
from diloco.deploy import commands as deploy_commands
from diloco.deploy import export as export_command
from diloco.exits import (  # noqa: F401  (re-exported: the exit-code contract, for callers of main)
    EXIT_AUTH_REFUSED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    UsageError,
    reported,
)
from diloco.observe import commands as observe_commands
from diloco.planner import command as plan_command
from diloco.sim import command as sim_command

#: Modules that register subcommands, in the order ``--help`` lists them.
COMMAND_MODULES = (demo_command, deploy_commands, check_log_command, export_command, observe_commands, sim_command,
                   plan_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco",
        description="DiLoCo training with an exact round state machine: no outer step is ever "
                    "applied with fewer than min_workers contributors. See README.md and SPEC.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 ok, 1 problem found, 2 bad usage or input, 3 coordinator unreachable, "
               "4 the coordinator refused this client's key, 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"diloco {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USAGE
    return reported(args.command, lambda: handler(args))


if __name__ == "__main__":
    sys.exit(main())
