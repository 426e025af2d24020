"""The machine a forecast is for: this one (its CPU, its peak the best measurement in the calibration store) or a catalog
accelerator (`--machine h100|h200|gaudi3|…`), with the rates the step-time model needs — peak FLOP/s per rank, the
fraction of it a run achieves when no probe has measured it, link bandwidths, memory and power — each a `Figure`
that says where it came from. A catalog accelerator that is also this machine's visible CUDA device reads this
machine's calibration store (its probes: `gaudi3 plan --probe`, tune trials, benchmark cells), as a CPU does."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import parse_yaml
from gaudi3_scale.device.efficiency import fallback_mfu
from gaudi3_scale.forecast.calibration import CalibrationStore, Probe, machine_key
from gaudi3_scale.forecast.figures import Figure, assumed, from_catalog, measured

if TYPE_CHECKING:
    from gaudi3_scale.device.specs import AcceleratorSpec

__all__ = ["Machine", "catalog_machine", "peak_label", "this_cpu"]


@dataclass(frozen=True, kw_only=True)
class Machine:
    kind: str  # "cpu" or a catalog name (h100-sxm, gaudi3, …)
    device_kind: str  # cpu | cuda | hpu: the trainer's device
    device_name: str
    ranks_per_node: int | None  # None: the config's nproc_per_node (a CPU)
    peak_flops_per_rank: Figure
    mfu: Figure  # achieved ÷ peak when no probe of this machine measured it
    memory_bytes_per_rank: Figure
    intra_node_bytes_per_s: Figure
    inter_node_bytes_per_s: Figure
    power_w_per_rank: Figure  # TDP; unknown on a CPU
    store: CalibrationStore | None = None  # this machine's calibration; None: a catalog machine not here


@functools.cache
def _links() -> tuple[dict[str, Figure], dict[str, Figure]]:
    raw = parse_yaml(
        (resources.files("gaudi3_scale.forecast") / "links.yaml").read_text(), where="links.yaml"
    )
    sources: dict[str, str] = raw["sources"]

    def figures(section: str) -> dict[str, Figure]:
        return {
            name: from_catalog(
                float(entry["value"]) * 1e9,
                f"{entry['note']}; " + "; ".join(sources[key] for key in entry["sources"]),
            )
            for name, entry in raw[section].items()
        }

    return figures("intra_node_gbs"), figures("inter_node_gbs")


def _local_gpu_store(accelerator: str) -> CalibrationStore | None:
    """This machine's calibration store when its visible CUDA device is the catalog's `accelerator`, else None.
    (Gaudi is not detected here: only `device/` imports habana modules, and only for a run that asks for hpu.)"""
    import torch

    from gaudi3_scale.device.specs import find_accelerator

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    spec = find_accelerator(name)
    if spec is None or spec.name != accelerator:
        return None
    return CalibrationStore.for_machine(machine_key(name, torch.cuda.device_count()))


def _probes_mfu(
    store: CalibrationStore, peak_of: Callable[[Probe], float | None], fallback: Figure
) -> Figure:
    """The median achieved ÷ peak of the store's probes (what runs reach on this machine), each over the peak it ran
    at (`peak_of`: a CPU probe's is that of its own threads per rank, a GPU probe's that of its own precision; None:
    a probe without a peak, left out), else `fallback`."""
    peaks = ((p, peak_of(p)) for p in store.probes.values())
    ratios = sorted(p.achieved_flops_per_rank / peak for p, peak in peaks if peak)
    if not ratios:
        return fallback
    return measured(
        ratios[len(ratios) // 2], f"median achieved ÷ peak of {len(ratios)} probe(s) on this machine"
    )


def _probe_peak(spec: AcceleratorSpec, probe: Probe, precision: str) -> float | None:
    """The rate a probe's own precision is timed at on `spec` (`precision`, the forecast's, for a probe whose layout
    does not say): its catalog peak (`_precision_peak`), for fp8 × the probe's model's modelled fp8 gain, as
    `forecast.model` times an fp8 step, at the probe's own train.fp8_* (its layout's `fp8`; the defaults for a
    probe stored before layouts recorded them). None: a precision the catalog has no peak for (fp32), or an fp8
    probe without its model."""
    from gaudi3_scale.config.core import from_dict
    from gaudi3_scale.device.float8 import Float8Plan
    from gaudi3_scale.forecast.shape import fp8_gain_figure
    from gaudi3_scale.models.config import ModelConfig
    from gaudi3_scale.train.config import RunConfig

    own = probe.layout.get("precision", precision)
    peak = _precision_peak(spec, own).value
    if own != "fp8" or peak is None:
        return peak
    model = probe.layout.get("model")
    if not isinstance(model, dict):
        return None
    recorded = probe.layout.get("fp8")
    float8 = from_dict(Float8Plan, recorded) if isinstance(recorded, dict) else RunConfig().float8_plan()
    gain = fp8_gain_figure(from_dict(ModelConfig, model), float8).value
    return None if gain is None else peak * gain


def _precision_peak(spec: AcceleratorSpec, precision: str) -> Figure:
    """The dense matmul peak a run in `precision` is timed at on `spec`, from the catalog; a precision whose peak
    the catalog lacks gets none (its step is not timed), never another precision's peak. An fp8 run's is the BF16
    one: only its linears run in fp8, so its step is the bf16 step ÷ fp8's modelled gain (`forecast.model`), as
    the trainer's MFU of an fp8 run is over the BF16 peak too (`device.select`)."""
    bf16 = f"BF16 dense peak {spec.bf16_dense_tflops:g} TFLOP/s"
    if precision == "fp8":
        fp8 = f"{spec.fp8_dense_tflops:g} TFLOP/s" if spec.fp8_dense_tflops is not None else "unknown"
        return from_catalog(spec.bf16_dense_tflops * 1e12, f"{bf16}; an fp8 run is timed as its bf16 step ÷ "
                            f"fp8's modelled gain (tune.fp8_gain), not at the FP8 dense peak {fp8}; {spec.source}")  # fmt: skip
    if precision == "32-true":
        # fp32 matmuls run as TF32 on tensor cores (train.tf32, on by default on CUDA) or as plain FP32: the catalog
        # (device/accelerators.yaml) has neither peak, and timing them at the BF16 one would be 2-15x short
        return assumed(None, f"not timed: the catalog has no FP32 or TF32 peak for {spec.name} (only BF16 and "
                       "FP8), whichever train.tf32 picks; a probe of this layout on this machine (gaudi3 plan "
                       "--probe) measures it")  # fmt: skip
    if precision == "16-mixed":
        return assumed(spec.bf16_dense_tflops * 1e12, f"FP16 taken at the {bf16}; the catalog has no FP16 peak; "
                       f"{spec.source}")  # fmt: skip
    # bf16-mixed, bf16-true, auto (bf16-mixed on an accelerator)
    return from_catalog(spec.bf16_dense_tflops * 1e12, f"{bf16}; {spec.source}")


def peak_label(peak: Figure) -> str:
    """The peak as a forecast line names it: the catalog's "BF16 dense peak 989.4 TFLOP/s", a measured CPU's
    "measured peak 0.123 TFLOP/s"."""
    if peak.kind in ("catalog", "assumption") and peak.value is not None:
        label = peak.source.split(": ", 1)[-1].split(";")[0]
        return label if peak.kind == "catalog" else f"assumption: {label}"
    return f"{peak.kind} peak {(peak.value or 0.0) / 1e12:.3g} TFLOP/s"


def catalog_machine(name: str, precision: str = "bf16-mixed") -> Machine:
    """A catalog accelerator by name or alias (`accelerators.yaml`); an unknown one is one line listing them.
    When this machine's visible device is that accelerator, its calibration store comes with it."""
    from gaudi3_scale.device.specs import ACCELERATORS, accelerator_named
    from gaudi3_scale.metering.catalog import accelerators_per_node

    try:
        spec = accelerator_named(name, flag="--machine")
    except UserInputError:
        known = ", ".join(["cpu", *sorted(ACCELERATORS)])
        raise UserInputError(f"--machine: unknown machine kind {name!r}; allowed: {known}") from None
    intra, inter = _links()
    kind = "hpu" if spec.name.startswith("gaudi") else "cuda"
    store = _local_gpu_store(spec.name) if kind == "cuda" else None
    peak = _precision_peak(spec, precision)
    mfu = Figure(*fallback_mfu(kind, spec.name))
    if store is not None and peak.value is not None:
        mfu = _probes_mfu(store, lambda probe: _probe_peak(spec, probe, precision), mfu)
    unknown_link = assumed(None, f"no sourced link bandwidth for {spec.name}: communication is not modelled")
    return Machine(
        kind=spec.name,
        device_kind=kind,
        device_name=spec.name,
        ranks_per_node=accelerators_per_node(spec.name),
        peak_flops_per_rank=peak,
        mfu=mfu,
        memory_bytes_per_rank=from_catalog(spec.memory_gb * 1e9, spec.source),
        intra_node_bytes_per_s=intra.get(spec.name, unknown_link),
        inter_node_bytes_per_s=inter.get(spec.name, unknown_link),
        power_w_per_rank=(
            from_catalog(spec.tdp_w, f"TDP; {spec.source}") if spec.tdp_w else assumed(None, "no sourced TDP")
        ),
        store=store,
    )


def this_cpu(
    ranks_per_node: int,
    *,
    threads: int | None = None,
    refresh_peak: bool = False,
    measure_peak: bool = False,
    store: CalibrationStore | None = None,
) -> Machine:
    """This machine's CPU: the peak matmul FLOP/s of one rank's threads (`threads`, the run's train.threads; None:
    the default, usable cores ÷ `ranks_per_node`), the best measurement kept in the machine's calibration store
    under `cpu-<threads>-threads` (`_cpu_peak`: `measure_peak` measures it now and keeps it if higher,
    `refresh_peak` replaces it); the MFU from this machine's probes when there are some, each probe's achieved
    FLOP/s over the peak of the threads it ran with."""
    import time

    import psutil

    from gaudi3_scale.device.select import cpu_model_name, cpu_threads_per_rank, usable_cpu_cores

    cores = usable_cpu_cores()
    name = cpu_model_name()
    store = store or CalibrationStore.for_machine(machine_key(name, cores))
    threads = threads or cpu_threads_per_rank(ranks_per_node)
    flops, measured_unix_s = _cpu_peak(store, threads, refresh=refresh_peak, measure=measure_peak)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(measured_unix_s))
    peak = measured(flops, f"best fp32 1024² matmul with {threads} thread(s) on {name}, {when} (the best "
                    f"measurement in calibration store {store.path}; --refresh-peak replaces it)")  # fmt: skip

    def probe_peak(probe: Probe) -> float:
        # a probe's layout names its threads only when not its ranks' default (`RunShape.threads`); a CPU probe
        # runs on this one node, so its ranks per node are its world size (a hand-edited value out of range: the
        # default's)
        layout = probe.layout
        threads, world = layout.get("threads"), layout.get("world_size")
        if not (isinstance(threads, int) and 1 <= threads <= cores):
            threads = cpu_threads_per_rank(world if isinstance(world, int) and world >= 1 else 1)
        return _cpu_peak(store, threads)[0]

    mfu = _probes_mfu(store, probe_peak, Figure(fallback_mfu("cpu")[0], "assumption: no probe on this machine "
                     "yet (gaudi3 plan --probe, a gaudi3 tune trial or a benchmark cell measures one)"))  # fmt: skip
    return Machine(
        kind="cpu",
        device_kind="cpu",
        device_name=name,
        ranks_per_node=None,
        peak_flops_per_rank=peak,
        mfu=mfu,
        memory_bytes_per_rank=measured(
            float(psutil.virtual_memory().total), "this machine's RAM (all ranks)"
        ),
        intra_node_bytes_per_s=assumed(
            None, "gloo over loopback is not modelled: a probe of the same layout measures it"
        ),
        inter_node_bytes_per_s=assumed(None, "CPU nodes' network is not modelled"),
        power_w_per_rank=assumed(None, "a CPU has no catalogued power"),
        store=store,
    )


def _cpu_peak(
    store: CalibrationStore, threads: int, *, refresh: bool = False, measure: bool = False
) -> tuple[float, float]:
    """(FLOP/s, when measured) of the best fp32 matmul with `threads` threads: the store's `cpu-<threads>-threads`
    slot. A slot that is empty is measured (about a second). `measure` (each `gaudi3 train` start) measures it
    again with the trainer's own call (`device.select.plan_device`: one measurement per process, which its MFU then
    uses too) and keeps it if higher: the store holds the best of its measurements, as one taken while the machine
    was busy understates the peak. `refresh` (`gaudi3 plan --refresh-peak`) replaces it."""
    from gaudi3_scale.device.select import measure_cpu_matmul_flops

    slot = f"cpu-{threads}-threads"
    if refresh:
        store.set_peak(slot, measure_cpu_matmul_flops(threads, seconds=1.0))
    elif measure:
        store.raise_peak(slot, measure_cpu_matmul_flops(threads))
    elif store.peak(slot) is None:
        store.set_peak(slot, measure_cpu_matmul_flops(threads, seconds=1.0))
    stored = store.peak(slot)
    assert stored is not None
    return stored
