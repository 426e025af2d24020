"""argparse `type=` functions the benchmark scripts share: a bad count is one line on stderr and exit code 2
(argparse turns an ArgumentTypeError into exactly that), never a traceback halfway through a run."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A whole number of at least 1 (counts: repeats, rounds, steps, clients)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of whole numbers of at least 1, e.g. `200,1000`."""
    words = [word.strip() for word in text.split(",") if word.strip()]
    if not words:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}")
    return [positive_int(word) for word in words]
