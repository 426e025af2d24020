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

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.config.files import parse_yaml, read_text_file
from gaudi3_scale.device.specs import ACCELERATORS

__all__ = [
    "DEFAULT_NODE_SIZE",
    "DEFAULT_PUE",
    "PUE_SOURCE",
    "Instance",
    "accelerators_per_node",
    "load_instances",
]

# Industry-average power usage effectiveness (total site power ÷ IT power): Uptime Institute, "Large data centers
# are mostly more efficient, analysis confirms" (UII Update 221, 23 Nov 2023): "In 2023, industry average PUE stood
# at 1.58". Hyperscale sites run lower; pass your own with `gaudi3 cost compare --pue`. `gaudi3 plan`'s energy uses it
# too (forecast.model), so it lives here, below both.
DEFAULT_PUE = 1.58
PUE_SOURCE = "Uptime Institute industry average for 2023 (UII Update 221, 2023-11-23)"
DEFAULT_NODE_SIZE = 8  # accelerators per node when the catalog has no instance (8-OAM Gaudi / HGX baseboards)
_PRICES = ("on_demand_usd_per_hour", "capacity_block_usd_per_hour")
_MAX_PER_NODE = 1024  # accelerators on one node; the largest today carry 8 (16 on a few NVL/UBB boards)
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
        raise UserInputError(f"{where}: {name} must be a positive number or null, got {brief(value)}")
    return float(value)


def _shown(value: Any) -> str:
    """A catalog value in a message: short text as it is, anything else as `brief` shows it."""
    return value if isinstance(value, str) and len(value) <= 60 else brief(value)


def _instance(entry: Any, sources: dict[str, str], where: str) -> Instance:
    if not isinstance(entry, dict):
        raise UserInputError(f"{where}: expected a mapping of instance fields, got {brief(entry)}")
    label = f"{where} ({_shown(entry.get('provider'))} {_shown(entry.get('type'))})"
    unknown = sorted(
        _shown(k) for k in set(entry) - _FIELDS
    )  # a key may be anything YAML reads: `1:`, `null:`
    missing = sorted(_FIELDS - set(entry))
    if unknown or missing:
        what = (
            f"unknown field(s) {', '.join(unknown)}" if unknown else f"missing field(s) {', '.join(missing)}"
        )
        raise UserInputError(f"{label}: {what}; fields: {', '.join(sorted(_FIELDS))}")
    for name in ("provider", "type", "region", "prices_date"):
        if not isinstance(entry[name], str) or not entry[name]:
            raise UserInputError(f"{label}: {name} must be a non-empty string, got {brief(entry[name])}")
    if not isinstance(entry["accelerator"], str) or entry["accelerator"] not in (*ACCELERATORS, "cpu"):
        raise UserInputError(
            f"{label}: accelerator {brief(entry['accelerator'])} is not in the catalog; known: "
            f"{', '.join(ACCELERATORS)}, cpu"
        )
    count = entry["accelerators_per_node"]
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= _MAX_PER_NODE:
        raise UserInputError(
            f"{label}: accelerators_per_node must be an integer from 1 to {_MAX_PER_NODE}, got {brief(count)}"
        )
    spot = entry["spot_usd_per_hour_range"]
    spot_range = None
    if spot is not None:
        if not isinstance(spot, list) or len(spot) != 2:
            raise UserInputError(
                f"{label}: spot_usd_per_hour_range must be [low, high] or null, got {brief(spot)}"
            )
        low, high = (_price(v, label, "spot_usd_per_hour_range") for v in spot)
        assert low is not None and high is not None
        if low > high:
            raise UserInputError(f"{label}: spot_usd_per_hour_range low {low} is above high {high}")
        spot_range = (low, high)
    cited = entry["sources"]
    if (
        not isinstance(cited, list)
        or not cited
        or any(not isinstance(s, str) or s not in sources for s in cited)
    ):
        raise UserInputError(
            f"{label}: sources must list keys of the file's sources ({', '.join(sources) or 'none'}), "
            f"got {brief(cited)}"
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
    raw = parse_yaml(text, where=where, expect=None)
    if not isinstance(raw, dict) or not isinstance(raw.get("instances"), list):
        raise UserInputError(f"{where}: expected a mapping with an 'instances' list (and 'sources')")
    sources = raw.get("sources") or {}
    if not isinstance(sources, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in sources.items()
    ):
        raise UserInputError(f"{where}: sources must map names to non-empty citations (text: text)")
    return [_instance(e, sources, f"{where}: instances[{i}]") for i, e in enumerate(raw["instances"])]


def load_instances(user_file: Path | None = None) -> dict[tuple[str, str, str], Instance]:
    """Shipped instances, then `user_file`'s (same provider, type and region: the user's entry wins)."""
    shipped = (resources.files("gaudi3_scale.metering") / "instances.yaml").read_text()
    found = {i.key: i for i in _read(shipped, "instances.yaml")}
    if user_file is not None:
        text = read_text_file(user_file, what="catalog file")
        found.update({i.key: i for i in _read(text, str(user_file))})
    return found


def accelerators_per_node(
    accelerator: str, instances: dict[tuple[str, str, str], Instance] | None = None
) -> int:
    """Accelerators on one node of `accelerator` (a catalog name): the most any catalog instance carries (8 for
    p5.48xlarge's H100s); `DEFAULT_NODE_SIZE` when no instance carries it (Gaudi 3: no sourced instance); 1 for
    "cpu"."""
    if accelerator == "cpu":
        return 1
    catalog = load_instances() if instances is None else instances
    offered = [i.accelerators_per_node for i in catalog.values() if i.accelerator == accelerator]
    return max(offered, default=DEFAULT_NODE_SIZE)
