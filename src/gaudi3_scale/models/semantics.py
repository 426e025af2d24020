"""What the models compute from the same weights and config, by the changes that altered it.

A change of that kind (the loss over another set of classes, another normalisation) leaves parameter names, shapes
and checkpoints as they were, so a checkpoint written before it resumes without error, on another objective. Each
such change is named here; every checkpoint records the names its run computed with (`model_semantics` in its
manifest), and a resume by a newer version names what changed for that checkpoint's model (`changes_missing_from`):
its logged loss may step at the resume, and a comparison with curves from before is off by that much.

Checkpoints written before the record existed (2026-11-30) have no list: a change counts as missing from them when
the checkpoint was created before the change landed (`since_unix_s`, its commit time, UTC).

Add a change here whenever what a model computes from a checkpoint's weights changes; never rename one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = ["MODEL_SEMANTICS", "SemanticsChange", "changes_missing_from", "model_semantics"]


@dataclass(frozen=True)
class SemanticsChange:
    """One change to what a model computes. `applies`: whether a run of this (saved, resolved) model section
    computes differently since (a change to padding rows means nothing to a model without any); `effect`: what a
    resume of such a checkpoint should know, one sentence."""

    name: str
    since_unix_s: int
    what: str
    applies: Callable[[Mapping[str, Any]], bool]
    effect: Callable[[Mapping[str, Any]], str]

    @property
    def since(self) -> str:
        return datetime.fromtimestamp(self.since_unix_s, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _padding_rows(model: Mapping[str, Any]) -> int:
    """Rows past the tokenizer's vocabulary in a resolved model section (0 when it cannot tell)."""
    vocab, multiple = model.get("vocab_size"), model.get("pad_vocab_to_multiple") or 1
    if not isinstance(vocab, int) or not isinstance(multiple, int) or vocab < 1 or multiple < 1:
        return 0
    return -(-vocab // multiple) * multiple - vocab


def _padding_effect(model: Mapping[str, Any]) -> str:
    rows = _padding_rows(model)
    return (
        f"its {rows} vocabulary padding row{'s' if rows != 1 else ''} took part in the softmax then and take none now: "
        "the loss it logs from here on may step down by up to the probability the model gave them"
    )


MODEL_SEMANTICS: tuple[SemanticsChange, ...] = (
    SemanticsChange(
        name="vocab-padding-masked",
        since_unix_s=1795900621,  # 2026-11-28 21:17:01 UTC
        what="the vocabulary padding rows take no part in the model's distribution (models.vocab)",
        applies=lambda model: _padding_rows(model) > 0,
        effect=_padding_effect,
    ),
)


def model_semantics() -> list[str]:
    """The names of every change this version's models compute with, for a checkpoint's manifest."""
    return [change.name for change in MODEL_SEMANTICS]


def changes_missing_from(manifest: Mapping[str, Any], model: Mapping[str, Any]) -> list[SemanticsChange]:
    """The changes a checkpoint's run did not compute with (from its manifest: its `model_semantics`, else its
    `created_unix_s`) that make a difference to its model (`model`, the checkpoint's saved model section)."""
    recorded = manifest.get("model_semantics")
    if isinstance(recorded, list):
        missing = [change for change in MODEL_SEMANTICS if change.name not in recorded]
    else:
        created = manifest.get("created_unix_s")
        if isinstance(created, bool) or not isinstance(created, int | float):
            return []  # nothing says when it was written: no claim either way
        missing = [change for change in MODEL_SEMANTICS if created < change.since_unix_s]
    return [change for change in missing if change.applies(model)]
