"""Checked numbers for command-line flags: one ``argparse`` ``type`` maker for every subcommand.

``flag_value(int, lambda v: v >= 1, ">= 1")`` parses a flag's text and refuses
what ``ok`` does not accept with an ``ArgumentTypeError`` saying what was
expected. Given ``flag``, the message names it ("--workers must be an integer
in 1..8, got 0"); without, argparse's own "argument --keep:" prefix does
("0 is not >= 1"). No diloco imports: the pure planner uses it too.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def flag_value(kind: type, ok: Callable[[float], bool], expected: str, flag: str | None = None):
    """An argparse ``type``: ``kind(text)`` (int or float; NaN never passes) that ``ok`` accepts."""
    noun = "an integer" if kind is int else "a number"

    def refuse(got: str, what: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"{flag} must be {expected}, got {got}" if flag else f"{got} is not {what}")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise refuse(repr(text), noun) from None
        if (kind is float and math.isnan(value)) or not ok(value):
            raise refuse(str(value) if kind is int else repr(text), expected)
        return value
    return parse
