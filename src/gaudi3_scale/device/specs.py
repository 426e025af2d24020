"""Accelerator peak throughput as data (`accelerators.yaml`), each number with its source. Unknown is absent, never
invented.

These peaks are the denominators of MFU (model FLOPs utilization, PaLM paper, Chowdhery et al. 2022, App. B).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from gaudi3_scale.config.files import parse_yaml

__all__ = ["ACCELERATORS", "AcceleratorSpec", "accelerator_named", "find_accelerator"]


@dataclass(frozen=True, kw_only=True)
class AcceleratorSpec:
    name: str
    match: tuple[str, ...]  # lower-case substrings of the device name reported by the runtime
    # whole lower-case device names, where a substring would also name other parts ("h200" ⊂ "h200 nvl", "gh200")
    match_exact: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # short names users type: "h100", "a100"
    bf16_dense_tflops: float
    fp8_dense_tflops: float | None
    memory_gb: float
    memory_bandwidth_tbps: float | None = None
    tdp_w: float | None = None
    source: str


_DATA = "accelerators.yaml"


def _load() -> dict[str, AcceleratorSpec]:
    """The shipped table (`device/accelerators.yaml`); a malformed entry is a programming error caught by the tests."""
    raw = parse_yaml((resources.files("gaudi3_scale.device") / _DATA).read_text(), where=_DATA)
    sources: dict[str, str] = raw["sources"]
    specs = {}
    for entry in raw["accelerators"]:
        cited = "; ".join(sources[key] for key in entry["sources"])
        note = entry.get("note")
        specs[entry["name"]] = AcceleratorSpec(
            name=entry["name"],
            match=tuple(entry["match"]),
            match_exact=tuple(entry.get("match_exact", ())),
            aliases=tuple(entry.get("aliases", ())),
            bf16_dense_tflops=float(entry["bf16_dense_tflops"]),
            fp8_dense_tflops=None if entry["fp8_dense_tflops"] is None else float(entry["fp8_dense_tflops"]),
            memory_gb=float(entry["memory_gb"]),
            memory_bandwidth_tbps=entry.get("memory_bandwidth_tbps"),
            tdp_w=entry.get("tdp_w"),
            source=cited + (f" ({note})" if note else ""),
        )
    return specs


ACCELERATORS: dict[str, AcceleratorSpec] = _load()


def find_accelerator(device_name: str) -> AcceleratorSpec | None:
    """The spec whose match strings occur in `device_name` (or whose exact names equal it), or None when we have no
    sourced number for it."""
    lowered = device_name.strip().lower()
    for spec in ACCELERATORS.values():
        if lowered in spec.match_exact or any(m in lowered for m in spec.match):
            return spec
    return None


def accelerator_named(name: str, *, flag: str = "--accelerator") -> AcceleratorSpec:
    """The spec a user means by `name`: its catalog name ("h100-sxm"), an alias ("h100", "a100"), an unambiguous
    prefix, or a runtime device name; else a UserInputError naming `flag` and what is known."""
    from gaudi3_scale.config.errors import UserInputError

    key = name.strip().lower()
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    for spec in ACCELERATORS.values():
        if key in spec.aliases:
            return spec
    prefixed = [spec for spec_name, spec in ACCELERATORS.items() if spec_name.startswith(key)]
    if key and len(prefixed) == 1:
        return prefixed[0]
    found = find_accelerator(key) if key else None
    if found is None:
        known = ", ".join(f"{n} ({'/'.join(s.aliases)})" if s.aliases else n for n, s in ACCELERATORS.items())
        raise UserInputError(f"{flag}: unknown accelerator {name!r}; known: {known}")
    return found
