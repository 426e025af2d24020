"""Time, cost and energy to train a model on each platform, from the catalog and the memory estimator.

For each platform (an accelerator in `device/accelerators.yaml`, or `cpu` measured on this machine):

* **accelerators to fit**: the fewest devices on which `tune.memory` says one training step fits (FSDP2 with
  ZeRO-3 sharding, which the trainer runs on every platform, Gaudi included; never DeepSpeed, refused on Gaudi;
  bf16-mixed, activation checkpointing, micro-batch 1, the model's context) within `memory_fraction` of the
  device's memory; whole nodes are rented, so the run uses every accelerator of those nodes (or of `nodes`).
* **training time** = tokens ÷ tokens per step × the step time of `gaudi3 plan`'s model (`cost.step_time`, over
  `forecast.model`): the step's FLOPs per rank (6·N + attention per token, `models/counting.py`, the blocks' ×
  4/3 under activation checkpointing) over peak × MFU, plus the communication the backward pass does not hide, or
  this machine's stored probe of the very layout. The MFU is the forecast machine's (ours measured where we have it, an
  assumption said so, this machine's probes), or given, or measured by benchmarks.
* **$**: node-hours × the instance's price (on-demand; spot as the catalog's range; capacity block) for the
  cheapest instance in the catalog that carries the accelerator. No price in the catalog → "unknown", never a
  guess.
* **energy** = accelerators × TDP × `power_fraction_of_tdp` × hours × PUE (accelerators only: hosts, network
  and storage are not counted); its $ only with a `usd_per_kwh`. Cloud prices already include power.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.config.numbers import INT64_MAX, is_number
from gaudi3_scale.cost.comparison import (
    DEFAULT_PUE,
    PUE_SOURCE,
    Assumptions,
    ComparisonData,
    PlatformEstimate,
)
from gaudi3_scale.cost.report import plot_tco_breakdown, write_report
from gaudi3_scale.device.specs import AcceleratorSpec, accelerator_named
from gaudi3_scale.metering.catalog import Instance, accelerators_per_node, load_instances

if TYPE_CHECKING:
    from gaudi3_scale.forecast.shape import RunShape
    from gaudi3_scale.models.config import ModelConfig

__all__ = [
    "DEFAULT_PUE",
    "PUE_SOURCE",
    "Assumptions",
    "CostComparison",
    "PlatformEstimate",
    "compare_training_cost",
    "parse_count",
    "resolve_model",
]

MAX_ACCELERATORS = 65536

_SUFFIX_EXPONENT = {"": 0, "K": 3, "M": 6, "B": 9, "G": 9, "T": 12, "P": 15}
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGTP]?)\s*$", re.IGNORECASE)


def parse_count(text: str | float | int, what: str) -> float:
    """'1T', '300B', '2.5e12', 70e9 → a whole number of at least 1 (returned as a float: it scales FLOPs);
    anything else — a fraction of a token ('1.5', '1e-300'), zero, more than 64 bits — is one line naming `what`."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise UserInputError(f"{what}: expected a number such as 1T, 300B or 2.5e12, got {brief(text)}")
    if isinstance(text, str):
        match = _COUNT.match(text)
        if not match:
            raise UserInputError(
                f"{what}: expected a number with an optional K, M, B, T suffix (e.g. 1T, 300B, 2.5e12), "
                f"got {brief(text)}"
            )
        # Exact: the suffix moves the decimal point of the digits as written ('1.1K' is 1100; in floats, 1.1 * 1e3
        # is 1100.0000000000002, and a Decimal product would round long digit strings to 28 places).
        try:
            sign, digits, exponent = Decimal(match.group(1)).as_tuple()
        except InvalidOperation:  # an exponent of 20+ digits, far outside the range below
            sign, digits, exponent = 0, (0,), 0
        assert isinstance(exponent, int)  # the pattern admits no nan or infinity
        value = Decimal((sign, digits, exponent + _SUFFIX_EXPONENT[match.group(2).upper()]))
    else:
        value = Decimal(text if math.isfinite(text) else 0)  # nan, inf: out of the range below
    if not 1 <= value <= INT64_MAX or value != value.to_integral_value():
        raise UserInputError(
            f"{what}: must be a whole number of tokens from 1 to {INT64_MAX:,} (2**63 - 1), e.g. 1T, 300B, "
            f"2.5e12 or 1000000, got {brief(text)}"
        )
    return float(value)


def resolve_model(model: str | ModelConfig, context_length: int | None = None) -> ModelConfig:
    """A registry preset ("llama3-70b"), a size naming one ("70B" → the preset whose name ends in -70b), or a
    config; its vocabulary resolved and, if given, its context replaced."""
    from gaudi3_scale.models.config import ModelConfig
    from gaudi3_scale.models.registry import get_model_config, list_models

    if isinstance(model, ModelConfig):
        cfg = model
    elif not isinstance(model, str):
        raise UserInputError(
            f"--model: expected a preset name ('llama3-70b'), a size naming one ('70B') or a ModelConfig, got "
            f"{brief(model)}"
        )
    else:
        key = model.strip().lower()
        names = list_models()
        if key in names:
            cfg = get_model_config(key)
        else:
            sized = [n for n in names if n.endswith(f"-{key}")]
            if len(sized) != 1:
                raise UserInputError(
                    f"--model: {model!r} is not a model preset or a size naming exactly one; presets: "
                    f"{', '.join(names)}"
                )
            cfg = get_model_config(sized[0])
    if context_length is not None:
        if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 1:
            raise UserInputError(f"--context-length: must be a positive integer, got {context_length!r}")
        cfg = dataclasses.replace(cfg, context_length=context_length)
    if cfg.vocab_size is None:
        from gaudi3_scale.data.config import DataConfig
        from gaudi3_scale.tune.estimate_table import resolved_model

        cfg = resolved_model(cfg, DataConfig())
    return cfg


class CostComparison(ComparisonData):
    """A comparison that can draw and write itself (`cost.report`)."""

    def plot_tco_breakdown(self, path: str | Path | None = None) -> Any:
        """A bar chart of each platform's cost (on-demand, spot range, energy); saved to `path` when given.

        Returns the matplotlib Figure."""
        return plot_tco_breakdown(self, path)

    def generate_report(self, path: str | Path) -> Path:
        """Write the comparison as .md, .html (self-contained) or .pdf, chosen by the suffix."""
        return write_report(self, Path(path))


def _platform_spec(name: str) -> AcceleratorSpec:
    if name.strip().lower() == "cpu":
        from gaudi3_scale.device.select import measured_cpu_spec

        return measured_cpu_spec()
    return accelerator_named(name, flag="--platforms")


def _device_kind(spec: AcceleratorSpec) -> str:
    if spec.name == "cpu":
        return "cpu"
    return "hpu" if spec.name.startswith("gaudi") else "cuda"


def _instance_for(spec: AcceleratorSpec, instances: dict[tuple[str, str, str], Instance]) -> Instance | None:
    """The instance a multi-node run would rent: the most accelerators per node, then the cheapest on-demand."""
    offered = [i for i in instances.values() if i.accelerator == spec.name]
    if not offered:
        return None
    return min(
        offered,
        key=lambda i: (
            -i.accelerators_per_node,
            i.on_demand_usd_per_hour is None,
            (i.on_demand_usd_per_hour or 0) / i.accelerators_per_node,
        ),
    )


def _per_device_bytes(
    model: ModelConfig,
    count: int,
    spec: AcceleratorSpec,
    a: Assumptions,
    *,
    per_node: int,
    mesh: bool = False,
) -> int:
    return _leanest_shape(model, count, spec, a, per_node=per_node, mesh=mesh)[1]


def _leanest_shape(
    model: ModelConfig,
    count: int,
    spec: AcceleratorSpec,
    a: Assumptions,
    *,
    per_node: int,
    mesh: bool = False,
) -> tuple[RunShape, int]:
    """The comparison's run on `count` devices and its memory per device, estimated as gaudi3 plan's memory
    (forecast.model) for the same shape: `a.strategy` as it is, or with `mesh` the layout of it that needs the
    least (`tune.layouts.mesh_candidates`: tensor parallel inside a node × pipeline parallel where the layers
    allow), for a model the plain layout fits on no device count."""
    from gaudi3_scale.cost.step_time import comparison_shape
    from gaudi3_scale.distributed.strategies import supported_strategies
    from gaudi3_scale.tune.layouts import mesh_candidates
    from gaudi3_scale.tune.memory import estimate_memory

    if a.strategy not in supported_strategies(_device_kind(spec)):
        raise UserInputError(
            f"strategy {a.strategy} is not one the trainer runs on {spec.name}; allowed: "
            f"{', '.join(supported_strategies(_device_kind(spec)))}"
        )
    best: tuple[RunShape, int] | None = None
    layouts = (
        mesh_candidates(model, a.strategy, world_size=count, per_node=per_node) if mesh else [(1, 1, ())]
    )
    for layout in layouts:
        shape = comparison_shape(
            model, count, per_node=per_node, device_kind=_device_kind(spec), a=a, layout=layout
        )
        need = estimate_memory(
            shape.model, shape.plan, shape.batch, precision=a.precision, device_kind=shape.device_kind
        ).total_bytes
        if best is None or need < best[1]:
            best = (shape, need)
    assert best is not None  # the plain layout is always a candidate
    return best


def _candidate_counts(per_node: int) -> list[int]:
    """1, 2, 4 … below a node, then 1, 2, 4 … whole nodes, up to MAX_ACCELERATORS."""
    counts = [c for c in (1, 2, 4) if c < per_node]
    nodes = 1
    while nodes * per_node <= MAX_ACCELERATORS:
        counts.append(nodes * per_node)
        nodes *= 2
    return counts


def _fewest_that_fit(
    model: ModelConfig, spec: AcceleratorSpec, per_node: int, a: Assumptions
) -> tuple[int | None, bool]:
    """The fewest candidate devices whose per-device estimate is within budget (None when even the most fail), and
    whether that takes tensor and pipeline parallel layouts: only when the plain layout fits on no count."""
    budget = spec.memory_gb * 1e9 * a.memory_fraction
    counts = _candidate_counts(per_node)
    mesh = _per_device_bytes(model, counts[-1], spec, a, per_node=per_node) > budget
    if mesh and _per_device_bytes(model, counts[-1], spec, a, per_node=per_node, mesh=True) > budget:
        return None, mesh
    low, high = 0, len(counts) - 1  # bisect: memory per device only falls as devices are added
    while low < high:
        mid = (low + high) // 2
        if _per_device_bytes(model, counts[mid], spec, a, per_node=per_node, mesh=mesh) <= budget:
            high = mid
        else:
            low = mid + 1
    return counts[low], mesh


def _row(
    platform: str,
    model: ModelConfig,
    tokens: float,
    *,
    nodes: int | None,
    mfu: float | None,
    measured: dict[str, tuple[float, str]],
    instances: dict[tuple[str, str, str], Instance],
    a: Assumptions,
) -> PlatformEstimate:
    from gaudi3_scale.cost.step_time import platform_machine, platform_step

    spec = _platform_spec(platform)
    instance = _instance_for(spec, instances)
    per_node = accelerators_per_node(spec.name, instances)  # the instance's, when there is one
    need, mesh = _fewest_that_fit(model, spec, per_node, a)
    machine, why_unknown = platform_machine(spec, a, mfu=mfu, benchmarked=measured)
    peak = machine.peak_flops_per_rank if machine is not None else None
    base: dict[str, Any] = dict(
        platform=platform,
        accelerator=spec.name,
        peak_tflops=(peak.value or 0.0) / 1e12 if peak is not None else spec.bf16_dense_tflops,
        peak_source=peak.source if peak is not None else spec.source,
        memory_gb=spec.memory_gb,
        tdp_w=spec.tdp_w,
        min_accelerators=need,
        per_node=per_node,
        mfu=machine.mfu.value if machine is not None else None,
        mfu_source=machine.mfu.source if machine is not None else why_unknown,
        instance=f"{instance.provider} {instance.type} {instance.region}" if instance else None,
        price_source=f"{instance.source} ({instance.prices_date})" if instance else None,
        on_demand_usd_per_node_hour=instance.on_demand_usd_per_hour if instance else None,
    )
    empty: dict[str, Any] = dict(
        nodes=None, accelerators=None, memory_per_device_gib=None, tokens_per_step=None, step_time_s=None,
        step_time_source=None, train_hours=None, accelerator_hours=None, on_demand_usd=None, spot_usd_low=None,
        spot_usd_high=None, capacity_block_usd=None, energy_kwh=None, energy_usd=None, usd_per_million_tokens=None,
        tokens_per_usd=None,
    )  # fmt: skip
    if need is None:
        largest = _candidate_counts(per_node)[-1]
        gib = _per_device_bytes(model, largest, spec, a, per_node=per_node, mesh=True) / 2**30
        note = (
            f"does not fit: even on {largest:,} devices one step needs {gib:,.1f} GiB per device (activations "
            f"of micro-batch 1 do not shrink with sharding), over {a.memory_fraction:.0%} of {spec.memory_gb:,.1f} GB"
        )
        return PlatformEstimate(**base, **empty, fits=False, note=note)
    run_nodes = nodes if nodes is not None else math.ceil(need / per_node)
    count = run_nodes * per_node
    if count < need:
        note = f"does not fit on {run_nodes} node(s) × {per_node}: needs at least {need} devices"
        return PlatformEstimate(
            **base, **{**empty, "nodes": run_nodes, "accelerators": count}, fits=False, note=note
        )
    shape, need_bytes = _leanest_shape(model, count, spec, a, per_node=per_node, mesh=mesh)
    gib = need_bytes / 2**30
    fitted = {**empty, "nodes": run_nodes, "accelerators": count, "memory_per_device_gib": gib,
              "tokens_per_step": shape.batch.tokens_per_step}  # fmt: skip
    if machine is None:
        return PlatformEstimate(**base, **fitted, fits=True, note=f"time unknown: {why_unknown}")
    step, mfu_used = platform_step(shape, machine)
    step_s = step["step_time_s"].value
    assert step_s is not None  # compute is always modelled; an untimed link adds nothing and says so
    hours = tokens / shape.batch.tokens_per_step * step_s / 3600
    node_hours = hours * run_nodes
    notes = []
    if mesh:
        plan = shape.plan
        pipeline = f" × pipeline parallel {plan.pp_size}" if plan.pipelined else ""
        notes.append(
            f"layout tensor parallel {plan.tp_size}{pipeline} (plain {a.strategy} fits on no device count)"
        )
    if step["communication_s"].value is None:
        notes.append("communication not timed: no sourced link bandwidth")
    on_demand = spot_low = spot_high = block = None
    if instance is None:
        notes.append("price unknown: no catalog instance carries this accelerator")
    else:
        if instance.on_demand_usd_per_hour is not None:
            on_demand = node_hours * instance.on_demand_usd_per_hour
        else:
            notes.append("on-demand price unknown")
        if instance.spot_usd_per_hour_range is not None:
            spot_low = node_hours * instance.spot_usd_per_hour_range[0]
            spot_high = node_hours * instance.spot_usd_per_hour_range[1]
        if instance.capacity_block_usd_per_hour is not None:
            block = node_hours * instance.capacity_block_usd_per_hour
    energy_kwh = energy_usd = None
    if spec.tdp_w is not None:
        energy_kwh = count * spec.tdp_w * a.power_fraction_of_tdp * hours * a.pue / 1000
        if a.usd_per_kwh is not None:
            energy_usd = energy_kwh * a.usd_per_kwh
    else:
        notes.append("energy unknown: no TDP")
    return PlatformEstimate(
        **{**base, "mfu": mfu_used.value, "mfu_source": mfu_used.source},
        **{
            **fitted,
            "step_time_s": step_s,
            "step_time_source": step["step_time_s"].source
            + ("" if step["step_time_s"].kind == "measured" else f" = {_step_parts(step)}"),
            "train_hours": hours,
            "accelerator_hours": hours * count,
            "on_demand_usd": on_demand,
            "spot_usd_low": spot_low,
            "spot_usd_high": spot_high,
            "capacity_block_usd": block,
            "energy_kwh": energy_kwh,
            "energy_usd": energy_usd,
            "usd_per_million_tokens": on_demand / (tokens / 1e6) if on_demand is not None else None,
            "tokens_per_usd": tokens / on_demand if on_demand else None,
        },
        fits=True,
        note="; ".join(notes),
    )


def _step_parts(step: dict[str, Any]) -> str:
    """ "compute 1.2 s (its source) + communication 0.3 s (its source)": where the step time comes from."""
    compute, comm = step["compute_s"], step["communication_s"]
    shown = "not timed" if comm.value is None else f"{comm.value:.4g} s"
    bubble = step.get("bubble_s")
    idle = f" + bubble {bubble.value:.4g} s ({bubble.source})" if bubble is not None and bubble.value else ""
    return f"compute {compute.value:.4g} s ({compute.source}) + communication {shown} ({comm.source}){idle}"


def measured_mfu(directory: Path, model: str) -> dict[str, tuple[float, str]]:
    """Per accelerator, the MFU of its ok benchmark results of `model` at the largest world size measured (the
    closest to a multi-node run; the best of those cells), with where it came from. A result whose MFU is not in
    (0, 1] is refused (a clock or peak bug, not a measurement), and so is a directory without a result of `model`:
    another model's MFU says little about this one's."""
    from gaudi3_scale.bench.report import load_results
    from gaudi3_scale.device.specs import find_accelerator

    best: dict[str, tuple[tuple[int, float], float, str]] = {}
    models: set[str] = set()
    for item in load_results([directory]):
        result = item.result
        metrics = result.get("metrics") or {}
        value = metrics.get("mfu")
        if result["status"] != "ok" or value is None:
            continue
        if not (isinstance(value, int | float) and 0 < value <= 1):
            raise UserInputError(f"--from-benchmarks: {item.path} reports an MFU of {value!r}, outside (0, 1]: "
                                 "a result with a wrong clock or peak; remove it or measure again")  # fmt: skip
        cell = result["cell"]
        models.add(str(cell["model"]))
        if cell["model"] != model:
            continue
        cuda = result["environment"].get("cuda")
        spec = find_accelerator(cuda["device"]) if cuda else None
        name = spec.name if spec else ("cpu" if not cuda else None)
        if name is None:
            continue
        where = f"measured: {cell['model']} {cell['strategy']} ×{cell['world_size']} {cell['precision']} ({item.path})"
        rank = (cell["world_size"], float(value))
        if name not in best or rank > best[name][0]:
            best[name] = (rank, float(value), where)
    if not models:
        raise UserInputError(f"--from-benchmarks: {directory} holds no ok benchmark result with an MFU")
    if not best:
        raise UserInputError(f"--from-benchmarks: {directory} holds no result of {model} (it has "
                             f"{', '.join(sorted(models))}); benchmark {model}, or drop --from-benchmarks")  # fmt: skip
    return {name: (value, where) for name, (_, value, where) in best.items()}


def compare_training_cost(
    model: str | ModelConfig,
    tokens: str | float,
    platforms: Sequence[str],
    *,
    mfu: float | None = None,
    from_benchmarks: Path | None = None,
    nodes: int | None = None,
    context_length: int | None = None,
    catalog_file: Path | None = None,
    assumptions: Assumptions | None = None,
) -> CostComparison:
    """One row per platform (see the module docstring). A model that fits on none of them is one line."""
    a = assumptions or Assumptions()
    if mfu is not None and (not is_number(mfu) or not 0 < mfu <= 1):
        raise UserInputError(f"--mfu: must be in (0, 1], got {brief(mfu)}")
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
        raise UserInputError(f"--nodes: must be a positive integer, got {nodes!r}")
    if isinstance(platforms, str):  # one name, or the CLI's comma-separated list: never its characters
        platforms = [name.strip() for name in platforms.split(",") if name.strip()]
    if not platforms:
        raise UserInputError("--platforms: name at least one (e.g. gaudi3,h100,a100)")
    for name, value in (("--pue", a.pue), ("--power-fraction", a.power_fraction_of_tdp)):
        if not math.isfinite(value) or value <= 0:
            raise UserInputError(f"{name}: must be a positive number, got {value!r}")
    if a.usd_per_kwh is not None and (not math.isfinite(a.usd_per_kwh) or a.usd_per_kwh < 0):
        raise UserInputError(f"--usd-per-kwh: must be a non-negative number, got {a.usd_per_kwh!r}")
    from gaudi3_scale.models.counting import count_parameters, flops_per_token

    cfg = resolve_model(model, context_length)
    count = parse_count(tokens, "--tokens")
    measured = measured_mfu(from_benchmarks, cfg.name) if from_benchmarks is not None else {}
    instances = load_instances(catalog_file)
    per_token = flops_per_token(cfg)
    training_flops = per_token * count
    given = None if measured else mfu
    rows = [
        _row(p.strip(), cfg, count, nodes=nodes, mfu=given, measured=measured, instances=instances, a=a)
        for p in dict.fromkeys(platforms)
    ]
    if not any(r.fits for r in rows):
        raise UserInputError(
            f"{cfg.name} (context {cfg.context_length:,}) fits on none of {', '.join(r.platform for r in rows)}: "
            + "; ".join(f"{r.platform}: {r.note.removeprefix('does not fit: ')}" for r in rows)
        )
    return CostComparison(
        model=cfg.name,
        parameters=count_parameters(cfg),
        flops_per_token=per_token,
        context_length=cfg.context_length,
        tokens=count,
        training_flops=training_flops,
        assumptions=a,
        rows=rows,
    )
