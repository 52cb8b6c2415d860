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
