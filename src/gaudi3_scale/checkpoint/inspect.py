"""Looking at checkpoints without training: list a run's checkpoints, find the first difference between two."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.checkpoint.manager import CheckpointManager
from gaudi3_scale.checkpoint.manifest import has_manifest, read_manifest, verify_checkpoint

__all__ = ["Difference", "checkpoint_rows", "first_difference", "shared_keys"]

# A value named in a difference is shown bounded: a checkpoint entry can be megabytes of nested optimizer state.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 60, 60
_MAX_REPR_CHARS = 200


def checkpoint_rows(directory: Path, *, verify: bool) -> list[dict[str, Any]]:
    """One row per `step-X` directory: committed?, intact? (with `verify`), size, tokens, validation loss."""
    manager = CheckpointManager(directory)
    latest = manager.pointed()
    rows = []
    for step, path in manager.steps():
        manifest = read_manifest(path) or {}
        problems = verify_checkpoint(path) if verify or (has_manifest(path) and not manifest) else []
        files = manifest.get("files", {})
        rows.append({
            "step": step,
            "path": str(path),
            "latest": path == latest,
            "committed": has_manifest(path),
            # A malformed manifest is damaged, named even without --verify (its fields cannot be shown).
            "status": "uncommitted" if not has_manifest(path) else (problems[0] if problems else ("ok" if verify else "-")),
            "size_bytes": sum(f["size_bytes"] for f in files.values()) if files else None,
            "tokens_seen": manifest.get("tokens_seen"),
            "world_size": manifest.get("world_size"),
            "strategy": manifest.get("strategy"),
            "val_loss": manifest.get("val_loss"),
        })  # fmt: skip
    return rows


@dataclass(frozen=True)
class Difference:
    key: str  # dotted path into the checkpoint, e.g. state_dict.model.output.weight
    detail: str


def _walk(a: Any, b: Any, key: str) -> Iterator[Difference]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            yield Difference(key, f"{type(a).__name__} vs {type(b).__name__}")
        elif a.dtype != b.dtype or a.shape != b.shape:
            yield Difference(key, f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif not torch.equal(a, b) and not (a.is_floating_point() and _equal_with_nans(a, b)):
            flat_a, flat_b = a.reshape(-1), b.reshape(-1)
            differs, diff = flat_a != flat_b, None
            if a.is_floating_point():  # NaN == NaN, as in _equal_with_nans (a NaN on one side only differs)
                differs &= ~(flat_a.isnan() & flat_b.isnan())
                diff = (flat_a[differs].double() - flat_b[differs].double()).abs().max().item()
            index = int(differs.nonzero()[0])
            where = f"first at flat index {index}: {flat_a[index].item()!r} vs {flat_b[index].item()!r}"
            yield Difference(key, where + (f"; max |a-b| {diff:.3g}" if diff is not None else ""))
    elif isinstance(a, dict) and isinstance(b, dict):
        for name in sorted(set(a) | set(b), key=str):
            if name not in a or name not in b:
                yield Difference(f"{key}.{name}".lstrip("."), "only in " + ("B" if name not in a else "A"))
            else:
                yield from _walk(a[name], b[name], f"{key}.{name}".lstrip("."))
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            yield Difference(key, f"{len(a)} items vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            yield from _walk(x, y, f"{key}[{i}]")
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    elif a != b:
        yield Difference(key, f"{_short(a)} vs {_short(b)}")


def _short(value: Any) -> str:
    text = _REPR.repr(value)
    return text if len(text) <= _MAX_REPR_CHARS else text[: _MAX_REPR_CHARS - 3] + "..."


def _equal_with_nans(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(
        torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


def first_difference(a: dict[str, Any], b: dict[str, Any], *, keys: tuple[str, ...]) -> Difference | None:
    """The first bitwise difference between two checkpoints in the given top-level entries, or None; an entry on
    one side only is `only in A` / `only in B`, one on neither side is passed over."""
    for key in keys:
        if key in a and key in b:
            for difference in _walk(a[key], b[key], key):
                return difference
        elif key in a or key in b:
            return Difference(key, "only in " + ("A" if key in a else "B"))
    return None


def shared_keys(a: dict[str, Any], b: dict[str, Any], *, keys: tuple[str, ...]) -> list[str]:
    """Those of `keys` that both checkpoints hold (what "identical" can be said of)."""
    return [key for key in keys if key in a and key in b]
