"""One calibration store per machine (`$GAUDI3_CACHE/calibration/<machine>.json`): the machine's peak matmul FLOP/s,
the best of its measurements (a busy machine's measurement only understates it; `gaudi3 train` measures it
again at each start; `gaudi3 plan --refresh-peak` replaces it), and the probes run on it — short real
runs of a model and layout, keyed by what decides their step time — so a later forecast of the same run, or of a
larger or longer one on the same kind of machine, uses measured rates, not an assumed MFU. Probes come from
`gaudi3 plan --probe` (`forecast.probe`) and from every successful `gaudi3 tune` trial and `gaudi3 benchmark run`
cell on this machine (`forecast.feed`). `--probe` replaces the layout's stored probe; a trial or a cell replaces
it only when it measured at least as long (seconds of steady steps).

The machine's key is its device name and core count (`machine_key`): a store found under another machine's key is
never read. Writes are atomic (a killed process leaves the previous store)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gaudi3_scale.config.atomic import write_text_atomic
from gaudi3_scale.config.errors import UserInputError

__all__ = ["CalibrationStore", "CalibrationStoreError", "Probe", "machine_key", "probe_key"]

FORMAT = "gaudi3-scale/calibration/1"


class CalibrationStoreError(UserInputError):
    """This machine's calibration store cannot be read. Not an input a run checks itself: `gaudi3 train` reports it
    as the reason it has no forecast, and trains on."""


def machine_key(device_name: str, cores: int) -> str:
    """A file-name-safe key of this machine: its device name and its cores (CPU) or devices."""
    readable = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")[:48]
    digest = hashlib.sha256(f"{device_name}|{cores}".encode()).hexdigest()[:8]
    return f"{readable}-{cores}c-{digest}"


def probe_key(layout: dict[str, Any]) -> str:
    """The key of a probe: a digest of what decides a step's time and memory (model, batch, layout, precision)."""
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class Probe:
    """A short real run's measurements (per rank)."""

    key: str
    layout: dict[str, Any]  # what the key digests, for reading the store by eye
    step_time_s: float  # steady state (after the warm-up steps)
    warmup_s: float  # the warm-up steps' wall time
    warmup_steps: int
    startup_s: float  # process start to the first step (launch, data, build), and the end of the run
    validation_s: float | None  # one validation pass (val_batches micro-batches), None: not measured
    checkpoint_s: float | None  # one save's blocking time
    peak_memory_bytes: int
    flops_per_step_per_rank: float
    # what measured it: "gaudi3 plan --probe", "tune trial OUT/trials/KEY", "benchmark cell OUT/cells/ID"
    origin: str = "gaudi3 plan --probe"
    measured_steps: int = (
        0  # steady steps behind step_time_s (0: not recorded, a store written before it was)
    )
    created_unix_s: float = field(default_factory=time.time)
    # how its save was made (checkpoint.async_save): an asynchronous save blocks a fraction of a synchronous one, so
    # `checkpoint_s` stands for a run's save only when both save alike; None: no save, or a store written before
    checkpoint_async_save: bool | None = None

    @property
    def measured_s(self) -> float:
        """Seconds of steady steps behind `step_time_s`: the longer, the less noise in it."""
        return self.measured_steps * self.step_time_s

    @property
    def achieved_flops_per_rank(self) -> float:
        return self.flops_per_step_per_rank / self.step_time_s

    def when(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.created_unix_s))

    def source(self) -> str:
        """How a forecast names this probe when it measured the very layout forecast."""
        return f"probe of this layout, from {self.origin}, {self.when()}"


# Fields added to Probe after the store's format was first released, left out of the file while "not recorded":
# one store is then read by the versions before them too (which refuse a field they do not know), on a machine
# where an older version still runs beside a newer one.
_ADDED_FIELDS = ("checkpoint_async_save",)


def _probe(fields: dict[str, Any]) -> Probe:
    """A stored probe; fields a newer version added are set aside (this version does not read them)."""
    known = Probe.__dataclass_fields__
    return Probe(**{name: value for name, value in fields.items() if name in known})


def _probe_fields(probe: Probe) -> dict[str, Any]:
    """A probe as stored: the fields added since the format's release only where recorded."""
    return {k: v for k, v in vars(probe).items() if not (k in _ADDED_FIELDS and v is None)}


class CalibrationStore:
    def __init__(self, path: Path, *, machine: str) -> None:
        self.path, self.machine = path, machine
        self.peaks: dict[str, dict[str, Any]] = {}  # "<threads or device>" -> {"flops", "measured_unix_s"}
        self.probes: dict[str, Probe] = {}
        if path.is_file():
            self._read()

    @classmethod
    def for_machine(cls, machine: str, cache_dir: Path | None = None) -> CalibrationStore:
        from gaudi3_scale.data.sources import default_cache_dir

        root = (cache_dir or default_cache_dir()) / "calibration"
        return cls(root / f"{machine}.json", machine=machine)

    def _read(self) -> None:
        delete = "delete it to start a new one"
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise CalibrationStoreError(
                f"{self.path}: calibration store cannot be read ({exc.strerror or exc})"
            ) from None
        # A store cut short (a full disk, a crash mid-copy) is not JSON, or not UTF-8 (both ValueErrors)
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise CalibrationStoreError(
                f"{self.path}: damaged calibration store, not JSON ({exc}); {delete}"
            ) from None
        if not isinstance(raw, dict):
            raise CalibrationStoreError(
                f"{self.path}: damaged calibration store (a JSON {type(raw).__name__}, not an object); {delete}"
            )
        if raw.get("format") != FORMAT or raw.get("machine") != self.machine:
            raise CalibrationStoreError(
                f"{self.path}: not a calibration store of this machine (format {raw.get('format')!r}, machine "
                f"{raw.get('machine')!r}; this machine is {self.machine!r}); {delete}"
            )
        try:
            self.peaks = {str(k): dict(v) for k, v in raw.get("peaks", {}).items()}
            self.probes = {k: _probe(v) for k, v in raw.get("probes", {}).items()}
        except (ValueError, TypeError, AttributeError) as exc:
            raise CalibrationStoreError(f"{self.path}: damaged calibration store ({exc}); {delete}") from None

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "format": FORMAT,
            "machine": self.machine,
            "peaks": self.peaks,
            "probes": {k: _probe_fields(p) for k, p in self.probes.items()},
        }
        write_text_atomic(self.path, json.dumps(body, indent=1, sort_keys=True) + "\n")

    def peak(self, slot: str) -> tuple[float, float] | None:
        """(FLOP/s, when measured) of the peak stored under `slot`, or None."""
        entry = self.peaks.get(slot)
        return None if entry is None else (float(entry["flops"]), float(entry["measured_unix_s"]))

    def set_peak(self, slot: str, flops: float) -> None:
        """Store `flops` as the slot's peak, whatever was there (`gaudi3 plan --refresh-peak`)."""
        self.peaks[slot] = {"flops": flops, "measured_unix_s": time.time()}
        self.save()

    def raise_peak(self, slot: str, flops: float) -> bool:
        """Store `flops` as the slot's peak when there is none or it is higher: a peak is a ceiling, and a
        measurement taken while the machine was busy only understates it (kept, it would slow every later
        forecast). Whether it was stored."""
        stored = self.peak(slot)
        if stored is not None and stored[0] >= flops:
            return False
        self.set_peak(slot, flops)
        return True

    def add_probe(self, probe: Probe, *, keep_longer: bool = False) -> bool:
        """Store `probe` as its layout's; `keep_longer`: not over a stored probe that measured longer (a tune
        trial's few steps do not replace a `--probe`'s ~10 s). Whether it was stored."""
        stored = self.probes.get(probe.key)
        if keep_longer and stored is not None and stored.measured_s > probe.measured_s:
            return False
        self.probes[probe.key] = probe
        self.save()
        return True

    def others(self, key: str) -> list[Probe]:
        """The stored probes of other layouts, newest first."""
        return sorted((p for k, p in self.probes.items() if k != key), key=lambda p: -p.created_unix_s)
