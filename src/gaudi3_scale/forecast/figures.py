"""A forecast's numbers, each with where it came from: a measured probe, the catalog (with its source), the
project's own measurement (with its file), a model (a formula over the others) or an assumption (said so)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Figure", "assumed", "from_catalog", "measured", "modelled", "unknown_after"]


@dataclass(frozen=True)
class Figure:
    value: float | None  # None: unknown (never guessed)
    source: str  # "probe: …", "calibration: …", "catalog: …", "measured: …", "model: …", "assumption: …"

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source}

    @property
    def kind(self) -> str:
        return self.source.split(":", 1)[0]


def measured(value: float | None, where: str) -> Figure:
    return Figure(value, f"measured: {where}")


def from_catalog(value: float | None, where: str) -> Figure:
    return Figure(value, f"catalog: {where}")


def modelled(value: float | None, how: str) -> Figure:
    return Figure(value, f"model: {how}")


def assumed(value: float | None, why: str) -> Figure:
    return Figure(value, f"assumption: {why}")


def unknown_after(cause: Figure) -> Figure:
    """An unknown figure that follows from the unknown `cause`, with its reason."""
    return assumed(None, cause.source.split(": ", 1)[-1])
