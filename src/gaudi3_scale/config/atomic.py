"""Writing a small file so that readers in other processes see the old contents or the new, never half: the text
goes to a temporary file beside it (named for this process, so concurrent writers do not share one), then
`os.replace` swaps it in."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_text_atomic"]


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
