"""The ``diloco`` command. Each subcommand lives with the code it drives.

A command module exposes ``register(subparsers)``, which adds its parser and
sets ``handler`` (a callable taking the parsed args and returning an exit
code). This file only wires them together and owns the exit-code contract:

    0  success
    1  the command ran and found a problem (failed check, invariant violated)
    2  bad usage (argparse) or bad input (unreadable file, invalid value)
    3  could not reach the coordinator within the timeout (admin commands: --timeout;
       ``diloco worker``: gave up after --coordinator-timeout, checkpoint written)
    4  the coordinator refused this client's key (authentication)
    130 interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from diloco import __version__

#: Modules that register subcommands, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "diloco.demo.command",
    "diloco.deploy.commands",
    "diloco.sim.command",
)

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH_REFUSED, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


class UsageError(Exception):
    """Bad input found after parsing (a file that is not there, an invalid combination)."""


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
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
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
    try:
        return int(handler(args) or 0)
    except UsageError as exc:
        print(f"diloco {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"diloco {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
