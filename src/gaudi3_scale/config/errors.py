"""The one exception type for bad user input, and how a user's value is shown in it.

Anything the user can get wrong (a config field, a CLI flag, a dataset on disk) raises `UserInputError` with a
message of one line naming *what* is wrong, *where* (a dotted field or a path) and *what is allowed*. The CLI turns
it into that line on stderr and exit code 2, without a traceback.

A message quotes the user's value with `brief`, never with a bare ``repr``: a value can be a 5,000-digit integer
(whose ``str`` Python refuses), or a list that YAML aliases make a billion items long, and the line must stay short
and cheap to build whatever the value is.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

__all__ = [
    "INTERRUPTED_EXIT_CODE",
    "MAX_ERROR_CHARS",
    "ConfigError",
    "UserInputError",
    "brief",
    "error_line",
    "print_error",
]

# A command stopped by Ctrl-C (SIGINT) before it finished: 128 + 2, what a shell reports for a program the signal
# ended, so scripts and supervisors tell it from bad input (2). A training run is the exception: it finishes its
# step, saves and exits 0 (`distributed.launch.signal_exit_code`).
INTERRUPTED_EXIT_CODE = 130


class UserInputError(ValueError):
    """Bad input from the user: printed as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        message = _unwrap_worker_traceback(type(self), message)
        # One line, always: user-supplied names and values may carry newlines of their own.
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


# torch re-raises an exception of a DataLoader worker (or its pin-memory thread) in the main process as
# `type(error)(text)`, the text: "Caught UserInputError in DataLoader worker process 0.\nOriginal Traceback (most
# recent call last):\n  File …\ngaudi3_scale.config.errors.UserInputError: <the message>\n" (torch._utils
# `ExceptionWrapper.reraise`). Squeezed into one line and cut to MAX_ERROR_CHARS, it lost the message's middle.
_WORKER_TRACEBACK = ".\nOriginal Traceback (most recent call last):\n"


def _unwrap_worker_traceback(cls: type[BaseException], message: str) -> str:
    """The original message of an exception torch re-raised from a worker (the text after the last
    `module.Class: ` line of the embedded traceback, several lines if it had several), else `message` as is."""
    head, found, trace = message.partition(_WORKER_TRACEBACK)
    if not (found and head.startswith(f"Caught {cls.__name__} ")):
        return message
    name = (
        cls.__qualname__
        if cls.__module__ in ("__main__", "builtins")
        else f"{cls.__module__}.{cls.__qualname__}"
    )
    _, found, original = trace.rpartition(f"\n{name}: ")
    return original.rstrip("\n") if found else message


class ConfigError(UserInputError):
    """An invalid config field; the message starts with the dotted field name (`problem` is the rest)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.problem = message
        super().__init__(f"{field}: {message}" if field else message)


class _Brief(reprlib.Repr):
    """`reprlib` with limits that bound both the text and the time: at most ~4 levels × 6 items are visited."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxset = self.maxdict = 5
        self.maxstring = 60
        self.maxother = 60

    def repr_int(self, x: int, level: int) -> str:
        if abs(x) < 10**40:
            return repr(x)
        # repr() of an integer above 4,300 digits raises ValueError; its size is what the reader needs anyway.
        digits = int(x.bit_length() * math.log10(2)) + 1
        return f"{'-' if x < 0 else ''}<an integer of about {digits:,} digits>"


_BRIEF = _Brief()
BRIEF_CHARS = 120


def brief(value: Any) -> str:
    """`repr(value)` for an error message: at most `BRIEF_CHARS` characters, and quick, whatever the value."""
    text = _BRIEF.repr(value)
    return text if len(text) <= BRIEF_CHARS else f"{text[: BRIEF_CHARS - 12]}…{text[-11:]}"


# The one place the CLI (and a training worker) prints an error: `gaudi3: error: <one line>` on stderr, at most
# `MAX_ERROR_CHARS` long. Messages quote user values briefly already (`brief`); the cap is the backstop for what
# still comes through long (a 5,000-character path, a tool's own message). 500, not less: the longest honest line
# today, an unknown `train.` field with the allowed ones listed, is ~350 characters.
MAX_ERROR_CHARS = 500
_TAIL_CHARS = 120  # the end of a message usually says what is allowed: keep it


def error_line(message: str) -> str:
    """`gaudi3: error: …`, one line, cut in the middle when longer than `MAX_ERROR_CHARS`."""
    line = "gaudi3: error: " + " ".join(message.splitlines())
    if len(line) > MAX_ERROR_CHARS:
        line = f"{line[: MAX_ERROR_CHARS - _TAIL_CHARS - 3]} … {line[-_TAIL_CHARS:]}"
    return line


def print_error(message: str) -> None:
    import click  # the CLI's dependency; this module stays importable without it

    click.echo(error_line(message), err=True)
