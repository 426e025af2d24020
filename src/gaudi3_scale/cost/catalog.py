"""The instance catalog: cloud instances, their accelerators and prices, each with its source and date.

The shipped `instances.yaml` can be extended or overridden by a user file of the same shape: an entry with the same
provider, type and region replaces the shipped one. Accelerator specs live in `device/accelerators.yaml`; an
instance names one of them. A malformed entry is one line naming it (UserInputError, exit 2 from the CLI).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.device.specs import ACCELERATORS

__all__ = ["Instance", "load_instances"]

_PRICES = ("on_demand_usd_per_hour", "capacity_block_usd_per_hour")
_FIELDS = {"provider", "type", "accelerator", "accelerators_per_node", "region", "spot_usd_per_hour_range",
           "prices_date", "sources", *_PRICES}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Instance:
    provider: str
    type: str
    accelerator: str  # a name in device/accelerators.yaml, or "cpu"
    accelerators_per_node: int
    region: str
    on_demand_usd_per_hour: float | None  # None: unknown, never guessed
    spot_usd_per_hour_range: tuple[float, float] | None
    capacity_block_usd_per_hour: float | None
    prices_date: str
    source: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.provider, self.type, self.region)


def _price(value: Any, where: str, name: str) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise UserInputError(f"{where}: {name} must be a positive number or null, got {value!r}")
    return float(value)


def _instance(entry: Any, sources: dict[str, str], where: str) -> Instance:
    if not isinstance(entry, dict):
        raise UserInputError(f"{where}: expected a mapping of instance fields, got {entry!r}")
    label = f"{where} ({entry.get('provider')} {entry.get('type')})"
    unknown = sorted(set(entry) - _FIELDS)
    missing = sorted(_FIELDS - set(entry))
    if unknown or missing:
        what = (
            f"unknown field(s) {', '.join(unknown)}" if unknown else f"missing field(s) {', '.join(missing)}"
        )
        raise UserInputError(f"{label}: {what}; fields: {', '.join(sorted(_FIELDS))}")
    for name in ("provider", "type", "region", "prices_date"):
        if not isinstance(entry[name], str) or not entry[name]:
            raise UserInputError(f"{label}: {name} must be a non-empty string, got {entry[name]!r}")
    if entry["accelerator"] not in (*ACCELERATORS, "cpu"):
        raise UserInputError(
            f"{label}: accelerator {entry['accelerator']!r} is not in the catalog; known: "
            f"{', '.join(ACCELERATORS)}, cpu"
        )
    count = entry["accelerators_per_node"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UserInputError(f"{label}: accelerators_per_node must be a positive integer, got {count!r}")
    spot = entry["spot_usd_per_hour_range"]
    spot_range = None
    if spot is not None:
        if not isinstance(spot, list) or len(spot) != 2:
            raise UserInputError(
                f"{label}: spot_usd_per_hour_range must be [low, high] or null, got {spot!r}"
            )
        low, high = (_price(v, label, "spot_usd_per_hour_range") for v in spot)
        assert low is not None and high is not None
        if low > high:
            raise UserInputError(f"{label}: spot_usd_per_hour_range low {low} is above high {high}")
        spot_range = (low, high)
    cited = entry["sources"]
    if not isinstance(cited, list) or not cited or any(s not in sources for s in cited):
        raise UserInputError(
            f"{label}: sources must list keys of the file's sources ({', '.join(sources) or 'none'}), got {cited!r}"
        )
    return Instance(
        provider=entry["provider"],
        type=entry["type"],
        accelerator=entry["accelerator"],
        accelerators_per_node=count,
        region=entry["region"],
        on_demand_usd_per_hour=_price(entry["on_demand_usd_per_hour"], label, "on_demand_usd_per_hour"),
        spot_usd_per_hour_range=spot_range,
        capacity_block_usd_per_hour=_price(
            entry["capacity_block_usd_per_hour"], label, "capacity_block_usd_per_hour"
        ),
        prices_date=entry["prices_date"],
        source="; ".join(sources[s] for s in cited),
    )


def _read(text: str, where: str) -> list[Instance]:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserInputError(f"{where}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("instances"), list):
        raise UserInputError(f"{where}: expected a mapping with an 'instances' list (and 'sources')")
    sources = raw.get("sources") or {}
    if not isinstance(sources, dict) or not all(isinstance(v, str) and v for v in sources.values()):
        raise UserInputError(f"{where}: sources must map keys to non-empty citations")
    return [_instance(e, sources, f"{where}: instances[{i}]") for i, e in enumerate(raw["instances"])]


def load_instances(user_file: Path | None = None) -> dict[tuple[str, str, str], Instance]:
    """Shipped instances, then `user_file`'s (same provider, type and region: the user's entry wins)."""
    shipped = (resources.files("gaudi3_scale.cost") / "instances.yaml").read_text()
    found = {i.key: i for i in _read(shipped, "instances.yaml")}
    if user_file is not None:
        try:
            text = user_file.read_text()
        except OSError as exc:
            raise UserInputError(
                f"{user_file}: cannot read the catalog file ({exc.strerror or exc})"
            ) from None
        found.update({i.key: i for i in _read(text, str(user_file))})
    return found
