"""The ``diloco`` command's exit codes and its one usage error, shared by every subcommand.

    0  success
    1  the command ran and found a problem (failed check, invariant violated)
    2  bad usage (argparse) or bad input (unreadable file, invalid value)
    3  could not reach the coordinator within the timeout (admin commands: --timeout;
       ``diloco worker``: gave up after --coordinator-timeout, checkpoint written)
    4  the coordinator refused this client's key (authentication)
    130 interrupted (Ctrl-C)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_AUTH_REFUSED = 4
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad input found after parsing (a file that is not there, an invalid combination): exit 2."""


def reported(command: str, run) -> int:
    """``run()``'s exit code, a usage error or a Ctrl-C said on stderr as ``diloco COMMAND: ...`` and
    turned into its code (anything else propagates)."""
    import sys

    try:
        return int(run() or 0)
    except UsageError as exc:
        print(f"diloco {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"diloco {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
