"""The one exception type for bad user input.

Anything the user can get wrong (a config field, a CLI flag, a dataset on disk) raises `UserInputError` with a
message of one line naming *what* is wrong, *where* (a dotted field or a path) and *what is allowed*. The CLI turns
it into that line on stderr and exit code 2, without a traceback.
"""

from __future__ import annotations

__all__ = ["ConfigError", "UserInputError"]


class UserInputError(ValueError):
    """Bad input from the user: printed as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        # One line, always: user-supplied names and values may carry newlines of their own.
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


class ConfigError(UserInputError):
    """An invalid config field; the message starts with the dotted field name."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)
