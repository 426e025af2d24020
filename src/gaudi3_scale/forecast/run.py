"""A forecast from what a user has: a config file and overrides (`gaudi3 plan`), or a resolved run config at the
start of `gaudi3 train` (`forecast_for_training`: no probe, the calibration store's probe of the layout when it has
one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from gaudi3_scale.forecast.calibration import Probe
from gaudi3_scale.forecast.figures import Figure, from_catalog
from gaudi3_scale.forecast.machine import Machine, catalog_machine, this_cpu
from gaudi3_scale.forecast.model import Forecast, RunShape, forecast_run
from gaudi3_scale.models import ModelConfig
from gaudi3_scale.train.config import RunConfig, resolve_config

__all__ = ["forecast_config", "forecast_for_training", "machine_for", "run_shape"]


def _precision(cfg: RunConfig, device_kind: str) -> str:
    precision = cfg.train.precision
    if precision == "auto":
        return "32-true" if device_kind == "cpu" else "bf16-mixed"
    return precision


def run_shape(cfg: RunConfig, model: ModelConfig, machine: Machine, *, nodes: int | None = None) -> RunShape:
    """The run's plans on `machine`: a catalog machine's nodes × its devices per node, else the config's geometry."""
    nodes = nodes or cfg.parallel.nnodes
    per_node = machine.ranks_per_node or cfg.parallel.nproc_per_node
    world = nodes * per_node
    precision = _precision(cfg, machine.device_kind)
    plan = cfg.parallel_plan(world, bf16_mixed=precision == "bf16-mixed")
    batch = cfg.batch_plan(world)
    threads = _threads(cfg, per_node) if machine.device_kind == "cpu" else None
    return RunShape.build(model, plan, batch, precision=precision, device_kind=machine.device_kind, nodes=nodes,
                          ranks_per_node=per_node, threads=threads)  # fmt: skip


def _threads(cfg: RunConfig, ranks_per_node: int) -> int | None:
    """`train.threads` when it is not the run's default (usable cores ÷ ranks, as `train.assembly` sets)."""
    from gaudi3_scale.device.select import cpu_threads_per_rank

    threads = cfg.train.threads
    return threads if threads not in (None, cpu_threads_per_rank(ranks_per_node)) else None


def machine_for(cfg: RunConfig, kind: str | None, *, refresh_peak: bool = False) -> Machine:
    """`--machine KIND` (a catalog accelerator, or cpu), or this machine: its visible GPU, else its CPU."""
    if kind in (None, "cpu") and cfg.train.device in ("auto", "cpu"):
        import torch

        if kind == "cpu" or cfg.train.device == "cpu" or not torch.cuda.is_available():
            return this_cpu(cfg.parallel.nproc_per_node, refresh_peak=refresh_peak)
        kind = torch.cuda.get_device_name()
    if kind is None:
        kind = "gaudi3" if cfg.train.device == "hpu" else "h100"
    return catalog_machine(kind, cfg.train.precision)


def _catalog_geometry(machine: str | None, nodes: int | None) -> list[str]:
    """The overrides that give the config a catalog machine's devices per node and the nodes forecast, so that the
    config's own checks (tensor parallel inside a node, pipeline stages dividing the ranks) see the cluster being
    forecast, not this one. Its nodes are `run_shape`'s. Several nodes need a rendezvous endpoint to pass the
    config's checks: a placeholder that nothing contacts, before the user's overrides (theirs wins)."""
    if machine in (None, "cpu"):
        return []
    per_node = catalog_machine(machine).ranks_per_node
    geometry = ["--parallel.nproc_per_node", str(per_node)] if per_node else []
    return geometry + (["--parallel.nnodes", str(nodes)] if nodes else [])


RENDEZVOUS_PLACEHOLDER = ["--parallel.rdzv_endpoint", "forecast-node-0:29400"]


def _price(cfg: RunConfig) -> Figure | None:
    from gaudi3_scale.metering.live import resolve_price

    price = resolve_price(cfg.cost)
    return None if price is None else from_catalog(price.usd_per_hour, f"$/node-hour: {price.source}")


def forecast_config(
    config_path: str | None,
    overrides: Sequence[str],
    *,
    machine: str | None = None,
    nodes: int | None = None,
    probe: bool = False,
    refresh_peak: bool = False,
    warn: Callable[[str], None] = print,
) -> tuple[RunConfig, Forecast]:
    from gaudi3_scale.tune.estimate_table import resolved_model

    cfg = resolve_config(
        config_path,
        [
            *(RENDEZVOUS_PLACEHOLDER if machine not in (None, "cpu") and (nodes or 1) > 1 else []),
            *overrides,
            *_catalog_geometry(machine, nodes),
        ],
    )
    if (
        cfg.train.max_epochs is not None
    ):  # as `gaudi3 train` resolves it: optimizer steps over the dataset's tokens
        from gaudi3_scale.data.inputs import open_training_data
        from gaudi3_scale.train.assembly import steps_of_epochs

        tokens_per_step = cfg.batch_plan(cfg.parallel.world_size).tokens_per_step
        train = steps_of_epochs(cfg.train, open_training_data(cfg.data, progress=False),
                                tokens_per_step=tokens_per_step, note=lambda line: None)  # fmt: skip
        cfg = dataclasses.replace(cfg, train=train)
    target = machine_for(cfg, machine, refresh_peak=refresh_peak)
    model = resolved_model(cfg.model, cfg.data)
    measured = None
    if probe:
        from gaudi3_scale.forecast.probe import probe_measured_steps, run_probe

        shape = run_shape(cfg, model, target, nodes=nodes)
        warmup = cfg.train.resolved_throughput_warmup_steps()
        first_guess = _forecast(cfg, shape, target).step_time_s  # sizes the probe: ~10 s of measured steps
        measured, why = run_probe(
            config_path,
            tuple(overrides),
            shape,
            val_batches=cfg.train.val_batches,
            warmup_steps=max(warmup, 2),
            measured_steps=probe_measured_steps(first_guess),
        )
        if measured is None:
            warn(f"--probe: {why}; the forecast comes from the catalog")
        elif target.store is not None:
            target.store.add_probe(measured)
            target = machine_for(cfg, machine)  # its MFU now counts the new probe
    return cfg, _forecast(cfg, run_shape(cfg, model, target, nodes=nodes), target, probe=measured)


def _forecast(
    cfg: RunConfig,
    shape: RunShape,
    machine: Machine,
    *,
    probe: Probe | None = None,
    start_step: int = 0,
    spent_usd: float | None = None,
) -> Forecast:
    return forecast_run(shape, machine, run_name=cfg.name, train=cfg.train, checkpoint=cfg.checkpoint,
                        probe=probe, price_usd_per_node_hour=_price(cfg), start_step=start_step,
                        spent_usd=spent_usd)  # fmt: skip


def forecast_for_training(cfg: RunConfig, model: ModelConfig) -> Forecast:
    """The forecast `gaudi3 train` records at its start (cheap: no probe; the store's probe of this layout). A
    resumed run's is from its checkpoint's step on, as its summary.json measures it (`forecast_run`)."""
    from gaudi3_scale.checkpoint.contents import COST_KEY
    from gaudi3_scale.train.resume import resume_manifest

    machine = machine_for(cfg, None)
    manifest = resume_manifest(cfg) or {}
    step, spent = manifest.get("step"), manifest.get(COST_KEY)
    start = step if isinstance(step, int) and 0 < step < cfg.train.max_steps else 0
    spent_usd = float(spent) if start and isinstance(spent, int | float) else None
    return _forecast(cfg, run_shape(cfg, model, machine), machine, start_step=start, spent_usd=spent_usd)
