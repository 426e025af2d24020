"""The one place the CLI prints an error: `gaudi3: error: <one line>` on stderr, at most `MAX_ERROR_CHARS` long.

Messages quote user values briefly already (`config.errors.brief`); the cap here is the backstop for what still
comes through long (a 5,000-character path, a tool's own message). 500, not less: the longest honest line today,
an unknown `train.` field with the allowed ones listed, is ~350 characters.
"""

from __future__ import annotations

import click

__all__ = ["MAX_ERROR_CHARS", "error_line", "print_error"]

MAX_ERROR_CHARS = 500
_TAIL_CHARS = 120  # the end of a message usually says what is allowed: keep it


def error_line(message: str) -> str:
    """`gaudi3: error: …`, one line, cut in the middle when longer than `MAX_ERROR_CHARS`."""
    line = "gaudi3: error: " + " ".join(message.splitlines())
    if len(line) > MAX_ERROR_CHARS:
        line = f"{line[: MAX_ERROR_CHARS - _TAIL_CHARS - 3]} … {line[-_TAIL_CHARS:]}"
    return line


def print_error(message: str) -> None:
    click.echo(error_line(message), err=True)
