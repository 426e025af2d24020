"""Writing a small file so that readers in other processes see the old contents or the new, never half: the text
goes to a temporary file beside it (named for this process, so concurrent writers do not share one), then
`os.replace` swaps it in.

A symbolic link is followed: its target is what gets replaced, the link stays (replacing the link would leave the
file it points to stale). A path that is not a regular file — a character device such as `/dev/null`, a FIFO, a
socket — cannot be swapped atomically and must not be replaced by a regular file (`--out /dev/null` would replace
the machine's /dev/null): it is written through, as a shell's `>` does."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

__all__ = ["write_text_atomic", "writes_through"]


def writes_through(path: Path) -> bool:
    """Whether `path` (followed through links) exists and is neither a regular file nor a directory: it is written
    in place, not replaced."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def write_text_atomic(path: Path, text: str) -> None:
    if writes_through(path):
        with open(path, "w", encoding="utf-8") as stream:
            stream.write(text)
        return
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk or a kill mid-write leaves no stray temporary file
            tmp.unlink()
        raise
