"""`gaudi3 tune --estimate-only`: the memory estimate of every strategy as a table, for any registry model; with
`--accelerator`, every layout the trainer supports there (tensor parallel, HSDP, offload) and whether it fits.

Nothing is built or run: the numbers come from `tune.memory`, the device memory from `device/specs.py`, the
accelerators per node from `metering/instances.yaml`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.device.float8 import Float8Plan
from gaudi3_scale.device.specs import AcceleratorSpec, accelerator_named
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.metering.catalog import accelerators_per_node
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.tune.layouts import LayoutCheck, check_layouts, tp_bytes_per_token
from gaudi3_scale.tune.memory import estimate_memory, max_micro_batch_that_fits, process_peak_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from gaudi3_scale.data.config import DataConfig
    from gaudi3_scale.train.config import RunConfig

__all__ = ["TABLE_STRATEGIES", "format_estimate_table", "format_layouts", "print_estimate_table"]

TABLE_STRATEGIES = ("ddp", "fsdp_grad_op", "fsdp", "deepspeed_zero2", "deepspeed_zero3")
_GIB = 2**30


def resolved_model(model: ModelConfig, data: DataConfig) -> ModelConfig:
    """`model` with its vocabulary resolved: from the config, else from the (prepared, cached) dataset `data`."""
    if model.vocab_size is not None:
        return model
    from gaudi3_scale.data.inputs import open_training_data

    return model.resolve_vocab(open_training_data(data, progress=False).vocab_size)


def format_estimate_table(
    model: ModelConfig,
    *,
    world_size: int,
    micro_batch_size: int = 1,
    context_length: int | None = None,
    precision: str = "auto",
    device_kind: str = "cpu",
    device_memory_bytes: int | None = None,
    strategies: Sequence[str] = TABLE_STRATEGIES,
    compiled: bool = False,
    float8: Float8Plan | None = None,
) -> str:
    """One row per strategy × activation checkpointing, sizes in GiB per rank.

    With `device_memory_bytes` (per device, e.g. `int(ACCELERATORS["gaudi3"].memory_gb * 1e9)`) a last column says
    whether the row fits and the largest micro-batch that would.
    """
    plans = [
        ParallelPlan.build(
            strategy=strategy,
            world_size=world_size,
            activation_checkpointing=ckpt,
            compile=compiled,
            float8=float8,
        )
        for strategy in strategies
        for ckpt in (False, True)
    ]
    tokens = context_length or 0  # 0: the model's
    rows = [
        estimate_memory(
            model,
            plan,
            BatchPlan.from_micro_batch(
                micro_batch_size, data_parallel_size=plan.data_parallel_size, context_length=tokens
            ),
            precision=precision,
            device_kind=device_kind,
        )
        for plan in plans
    ]
    first = rows[0]
    size = f"{first.parameters / 1e9:.3g} B" if first.parameters >= 1e9 else f"{first.parameters / 1e6:.3g} M"
    lines = [
        f"{model.name}: {size} parameters, {world_size} rank(s), micro-batch "
        f"{micro_batch_size} × {first.context_length} tokens, {first.precision}, {device_kind}"
        + (", torch.compile" if compiled else "")
        + (f", {device_memory_bytes / _GIB:.2f} GiB per device" if device_memory_bytes else ""),
    ]
    header = ["strategy", "act.ckpt", *(name for name, _ in first.rows()), "total GiB", "peak at"]
    if device_memory_bytes:
        header.append("fits (max micro-batch)")
    table = [header]
    for plan, est in zip(plans, rows, strict=True):
        row = [est.strategy, "on" if est.activation_checkpointing else "off"]
        row += [f"{b / _GIB:.2f}" for _, b in est.rows()] + [f"{est.total_bytes / _GIB:.2f}", est.peak_phase]
        if device_memory_bytes:
            best = max_micro_batch_that_fits(
                model,
                plan,
                budget_bytes=device_memory_bytes,
                context_length=tokens,
                precision=precision,
                device_kind=device_kind,
            )
            fits = process_peak_bytes(est) <= device_memory_bytes  # on a CPU with what glibc keeps
            row.append(("yes" if fits else "no") + f" ({best})")
        table.append(row)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        cells = zip(r, widths, strict=True)
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(cells)))
    if device_kind == "hpu":
        lines.append(
            "on hpu this codebase trains with ddp, fsdp and fsdp_grad_op (distributed/strategies.py; not yet "
            "validated on Gaudi hardware); the DeepSpeed rows are what-ifs"
        )
    lines.append(
        "per rank; runtime = process baseline (empirical on CPU, 0 on CUDA, unknown on HPU); "
        "formulas: ZeRO (arXiv:1910.02054), Korthikanti et al. (arXiv:2205.05198), see gaudi3_scale.tune.memory"
    )
    return "\n".join(lines)


def format_layouts(
    model: ModelConfig,
    spec: AcceleratorSpec,
    *,
    world_size: int,
    per_node: int,
    micro_batch_size: int = 1,
    precision: str = "bf16-mixed",
    compiled: bool = False,
    float8: Float8Plan | None = None,
) -> str:
    """One line per layout (`tune.layouts`), fastest first: fits or not, and why not."""
    device_kind = device_kind_of(spec)
    device_bytes = int(spec.memory_gb * 1e9)
    checks = check_layouts(
        model,
        world_size=world_size,
        per_node=per_node,
        device_kind=device_kind,
        device_bytes=device_bytes,
        micro_batch_size=micro_batch_size,
        precision=precision,
        compiled=compiled,
        float8=float8,
    )
    first = checks[0].estimate
    nodes = max(1, world_size // per_node)
    lines = [
        f"{model.name}: {first.parameters / 1e9:.3g} B parameters on {world_size} × {spec.name} "
        f"({nodes} node(s) × {min(per_node, world_size)}), {spec.memory_gb:g} GB = {device_bytes / _GIB:.1f} GiB "
        f"per device; micro-batch {micro_batch_size} × {first.context_length} tokens, {first.precision}",
        f"{sum(c.fits for c in checks)} of {len(checks)} layouts fit; fastest first (tune.layouts); offload is "
        "tried only for a layout that does not fit without it",
    ]
    for check in checks:
        est, lay = check.estimate, check.layout
        host = f", host {check.host_bytes_per_node / _GIB:.1f} GiB/node" if est.host_bytes else ""
        if check.fits:
            detail = f"{est.total_bytes / _GIB:.1f} GiB per device{host}, largest micro-batch {check.max_micro_batch}"
            lines.append(f"fits          {lay.label(world_size)}: {detail}")
        else:
            lines.append(f"does not fit  {lay.label(world_size)}: {check.reason(spec.name)}{host}")
    if checks[0].fits:
        lines.append("the first as `gaudi3 train` overrides: " + " ".join(checks[0].layout.overrides()))
    if any(c.estimate.host_bytes for c in checks):
        lines.append(
            "host memory per node is not checked: the catalog has no sourced host RAM for these nodes"
        )
    if device_kind == "hpu":
        lines.append(
            "on Gaudi the trainer builds ddp and FSDP2 (fsdp, fsdp_grad_op; tensor parallel and HSDP meshes) over "
            "HCCL, not yet validated on Gaudi hardware; DeepSpeed is not proposed there"
        )
    traffic = ", ".join(
        f"tp {t}: {tp_bytes_per_token(model, t) / 1e6:.1f} MB/token" for t in _tps(checks) if t > 1
    )
    lines.append(
        "ranking model: offload, then recomputation (+1/3 FLOPs), then pipeline stages (the bubble), then "
        "tensor-parallel traffic"
        + (f" (per rank {traffic})" if traffic else "")
        + ", then strategy and HSDP; see gaudi3_scale.tune.layouts"
    )
    return "\n".join(lines)


def _tps(checks: Sequence[LayoutCheck]) -> list[int]:
    return sorted({c.layout.tp_size for c in checks})


def device_kind_of(spec: AcceleratorSpec) -> str:
    """The trainer's device kind for a catalog accelerator: gaudi* → hpu, the others → cuda."""
    return "hpu" if spec.name.startswith("gaudi") else "cuda"


def print_estimate_table(
    base: RunConfig,
    *,
    world_size: int,
    memory_budget_bytes: int | None,
    accelerator: str | None,
    console: Console,
) -> None:
    """Print the table for `base`'s model at the micro-batch its run would use on `world_size` ranks (the batch
    plan's: global batch ÷ data-parallel ranks when `train.micro_batch_size` is unset, 1 under a pipeline, as
    `gaudi3 train` does; 1 when the global batch does not split over them), context and precision.

    `accelerator` (a name in `device/specs.py`) without a budget: every layout the trainer supports on
    `world_size` of them (all devices, whole nodes of the catalog's accelerators per node) and whether it fits
    (`format_layouts`). Otherwise the strategy table: `accelerator` sets the device kind (gaudi → hpu, others →
    cuda) and the memory each row is checked against; `memory_budget_bytes` overrides that memory. Neither: rows
    are not checked, and the device kind is the config's `train.device` (auto → cpu).
    """
    device_kind: str = base.train.device if base.train.device != "auto" else "cpu"
    float8 = base.float8_plan() if base.train.precision == "fp8" else None
    memory = memory_budget_bytes
    try:
        micro = base.batch_plan(world_size).micro_batch_size
    except ConfigError:  # a world size the global batch does not split over: what one sequence per rank needs
        micro = base.train.micro_batch_size or 1
    spec = accelerator_named(accelerator) if accelerator else None
    if spec is not None and memory is None:
        per_node = accelerators_per_node(spec.name)
        if world_size > per_node and world_size % per_node:
            raise UserInputError(
                f"--world-size: {world_size} is not a whole number of {spec.name} nodes ({per_node} per node); "
                f"allowed: up to {per_node}, or a multiple of it"
            )
    if spec is not None:
        console.print(
            f"device: {spec.name}, {spec.memory_gb:g} GB (source: {spec.source})",
            highlight=False,
            soft_wrap=True,
        )
    if spec is not None and memory is None:
        text = format_layouts(
            resolved_model(base.model, base.data).resolve_padding(device_kind_of(spec)),
            spec,
            world_size=world_size,
            per_node=per_node,
            micro_batch_size=micro,
            precision=base.train.precision,
            compiled=base.train.compile,
            float8=float8,
        )
        console.print(text, highlight=False, soft_wrap=True)
        return
    if spec is not None:
        device_kind = device_kind_of(spec)
        if memory is None:
            memory = int(spec.memory_gb * 1e9)
    table = format_estimate_table(
        # the vocabulary padded as the trainer pads it on this device, as gaudi3 plan's memory (forecast.model)
        resolved_model(base.model, base.data).resolve_padding(device_kind),
        world_size=world_size,
        micro_batch_size=micro,
        precision=base.train.precision,
        device_kind=device_kind,
        device_memory_bytes=memory,
        compiled=base.train.compile,
        float8=float8,
    )
    console.print(table, highlight=False, soft_wrap=True)
