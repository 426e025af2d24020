"""A forecast from what a user has: a config file and overrides (`gaudi3 plan`), or a resolved run config at the
start of `gaudi3 train` (`forecast_for_training`: no probe, the calibration store's probe of the layout when it has
one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.forecast.calibration import Probe
from gaudi3_scale.forecast.figures import Figure, from_catalog
from gaudi3_scale.forecast.machine import Machine, catalog_machine, this_cpu
from gaudi3_scale.forecast.model import Forecast, forecast_run
from gaudi3_scale.forecast.shape import RunShape
from gaudi3_scale.models import ModelConfig
from gaudi3_scale.train.config import RunConfig, build_run_config

__all__ = [
    "check_runs_on",
    "forecast_config",
    "forecast_for_training",
    "machine_for",
    "resolve_forecast_config",
    "run_shape",
    "threads_per_rank",
]


def _precision(cfg: RunConfig, device_kind: str) -> str:
    precision = cfg.train.precision
    if precision == "auto":
        return "32-true" if device_kind == "cpu" else "bf16-mixed"
    return precision


def run_shape(cfg: RunConfig, model: ModelConfig, machine: Machine) -> RunShape:
    """The run's plans on `machine` in the config's geometry: parallel.nnodes × parallel.nproc_per_node ranks (a
    `--machine` forecast's config has that machine's node: `forecast_config`), never the catalog's node in place of
    it: a 1-GPU run is forecast as one rank."""
    nodes, per_node = cfg.parallel.nnodes, cfg.parallel.nproc_per_node
    world = nodes * per_node
    precision = _precision(cfg, machine.device_kind)
    # fp8's linears and head as train.fp8_* convert them: what its modelled gain over bf16 is of (RunShape.fp8_gain)
    plan = cfg.parallel_plan(world, float8=precision == "fp8", bf16_mixed=precision == "bf16-mixed")
    batch = cfg.batch_plan(world)
    threads = _threads(cfg) if machine.device_kind == "cpu" else None
    return RunShape.build(model, plan, batch, precision=precision, device_kind=machine.device_kind, nodes=nodes,
                          ranks_per_node=per_node, threads=threads)  # fmt: skip


def check_runs_on(cfg: RunConfig, device_kind: str) -> None:
    """The trainer's own refusals of `cfg` on `device_kind` (cpu, cuda or hpu), for a run planned or deployed
    elsewhere: its strategy (`distributed.strategies.check_strategy_on`), the train options one device kind runs
    (`train.assembly.check_device_options`) and, on Gaudi, its precision (`device.select`). One line, the field
    named, as the trainer would say it on every rank."""
    from gaudi3_scale.distributed.strategies import check_strategy_on
    from gaudi3_scale.train.assembly import check_device_options  # imports torch

    precision = _precision(cfg, device_kind)
    if device_kind == "hpu":
        from gaudi3_scale.device.select import hpu_precision

        precision = hpu_precision(cfg.train.precision)
    plan = cfg.parallel_plan(cfg.parallel.world_size, bf16_mixed=precision == "bf16-mixed")
    check_strategy_on(plan.runs_as(device_kind), device_kind)
    check_device_options(cfg.train, device_kind)


def threads_per_rank(cfg: RunConfig) -> int:
    """The CPU intra-op threads per rank a run of `cfg` uses: `train.threads`, else the usable cores shared by its
    ranks per node (as `train.assembly` sets them). The forecast's CPU peak is that of these threads."""
    from gaudi3_scale.device.select import cpu_threads_per_rank

    return cfg.train.threads or cpu_threads_per_rank(cfg.parallel.nproc_per_node)


def _threads(cfg: RunConfig) -> int | None:
    """The run's threads per rank when not the default (the layout's key names only those: `RunShape.threads`)."""
    from gaudi3_scale.device.select import cpu_threads_per_rank

    threads = threads_per_rank(cfg)
    return threads if threads != cpu_threads_per_rank(cfg.parallel.nproc_per_node) else None


def machine_for(
    cfg: RunConfig, kind: str | None, *, refresh_peak: bool = False, measure_peak: bool = False
) -> Machine:
    """`--machine KIND`: a catalog accelerator, or this machine's CPU for `cpu` — whatever train.device says, as
    any --machine stands in for the config's device. Without it, the device the run trains on here. On a CPU,
    `measure_peak` measures its peak now and keeps it when higher than the stored one, `refresh_peak` replaces
    it (`machine._cpu_peak`)."""
    if kind == "cpu":
        return _this_cpu(cfg, refresh_peak=refresh_peak, measure_peak=measure_peak)
    if kind is not None:
        return catalog_machine(kind, cfg.train.precision)
    import torch

    from gaudi3_scale.device.select import resolve_device

    # train.device as the trainer resolves it (`device.select.plan_device`): auto is this machine's visible CUDA
    # GPU, else its Gaudi, else its CPU. Not validated on Gaudi hardware.
    device = resolve_device(cfg.train.device)
    if device == "cpu":
        return _this_cpu(cfg, refresh_peak=refresh_peak, measure_peak=measure_peak)
    if device == "hpu":
        return _this_gaudi(cfg.train.precision)
    if not torch.cuda.is_available():  # a cuda run forecast on paper from a machine without a GPU
        return catalog_machine("h100", cfg.train.precision)
    return catalog_machine(_this_gpu(), cfg.train.precision)


def _this_gaudi(precision: str) -> Machine:
    """This node's Gaudi as the catalog names it; without one visible here, a Gaudi 3, said so in the machine's
    name (the forecast's first line), as Gaudi 2 and 3 differ 3.9× in peak and 96 vs 128 GB in memory. Not yet
    validated on Gaudi hardware."""
    from gaudi3_scale.device.select import detected_hpu_name
    from gaudi3_scale.device.specs import ACCELERATORS, find_accelerator

    name = detected_hpu_name()
    if name is None:
        machine = catalog_machine("gaudi3", precision)
        return dataclasses.replace(
            machine,
            device_name=f"{machine.device_name} assumed: no Gaudi visible here; choose with --machine gaudi2|gaudi3",
        )
    spec = find_accelerator(name)
    if spec is None:
        raise UserInputError(f"train.device: this node's Gaudi {name!r} has no catalogued peak FLOP/s to forecast "
                             f"with; forecast a catalogued one with --machine ({', '.join(sorted(ACCELERATORS))})")  # fmt: skip
    return catalog_machine(spec.name, precision)


def _this_cpu(cfg: RunConfig, *, refresh_peak: bool, measure_peak: bool) -> Machine:
    """This CPU at the peak of the threads each rank of `cfg` runs with."""
    return this_cpu(cfg.parallel.nproc_per_node, threads=threads_per_rank(cfg), refresh_peak=refresh_peak,
                    measure_peak=measure_peak)  # fmt: skip


def _this_gpu() -> str:
    """This machine's visible CUDA device, as the catalog names it; one line when the catalog has no figures for it."""
    import torch

    from gaudi3_scale.device.specs import ACCELERATORS, find_accelerator

    name = torch.cuda.get_device_name()
    spec = find_accelerator(name)
    if spec is None:
        raise UserInputError(f"train.device: this machine's GPU {name!r} has no catalogued peak FLOP/s to forecast "
                             f"with; forecast a catalogued one with --machine ({', '.join(sorted(ACCELERATORS))})")  # fmt: skip
    return spec.name


# Set under the user's config and overrides (theirs wins: `build_run_config(base=...)`): a rendezvous endpoint that
# nothing contacts, so that a forecast of several nodes (parallel.nnodes or --nodes) passes the config's check for one.
RENDEZVOUS_PLACEHOLDER = "forecast-node-0:29400"


def resolve_forecast_config(
    config_path: str | None, overrides: Sequence[str], machine: str | None, nodes: int | None
) -> RunConfig:
    """The config forecast: with `--machine X` (a catalog accelerator), a full node of X unless
    parallel.nproc_per_node is set (then at most X's devices per node), and `--nodes` over parallel.nnodes — so that
    the config's own checks (tensor parallel inside a node, pipeline stages dividing the ranks) see the cluster being
    forecast, not this one."""
    node = catalog_machine(machine).ranks_per_node if machine not in (None, "cpu") else None
    base: dict[str, Any] = {"rdzv_endpoint": RENDEZVOUS_PLACEHOLDER}
    if node:
        base["nproc_per_node"] = node
    pairs = [*parse_overrides(list(overrides)), *([("parallel.nnodes", nodes)] if nodes else [])]
    if _endpoint_nulled(config_path, pairs):  # a saved config.yaml says `rdzv_endpoint: null`
        pairs.append(("parallel.rdzv_endpoint", RENDEZVOUS_PLACEHOLDER))
    cfg = build_run_config(config_path, pairs, base={"parallel": base})
    if node and cfg.parallel.nproc_per_node > node:
        raise ConfigError("parallel.nproc_per_node", f"{cfg.parallel.nproc_per_node} ranks per node, but --machine "
                          f"{machine} has {node} devices per node; allowed: 1 to {node} (unset: the whole node)")  # fmt: skip
    return cfg


def _endpoint_nulled(config_path: str | None, pairs: Sequence[tuple[str, Any]]) -> bool:
    """Whether the user's config leaves parallel.rdzv_endpoint null in so many words (every config a run saves
    does), which the placeholder under it would not replace; an endpoint the user set is theirs."""
    from gaudi3_scale.config.core import load_yaml

    given = [value for key, value in pairs if key == "parallel.rdzv_endpoint"]
    if given:
        return given[-1] in (None, "null", "")
    parallel = (load_yaml(config_path) if config_path is not None else {}).get("parallel")
    return isinstance(parallel, dict) and "rdzv_endpoint" in parallel and parallel["rdzv_endpoint"] is None


def _price(cfg: RunConfig) -> Figure | None:
    from gaudi3_scale.metering.live import resolve_price

    price = resolve_price(cfg.cost)
    return None if price is None else from_catalog(price.usd_per_hour, f"$/node-hour: {price.source}")


def _check_instance(cfg: RunConfig, machine: Machine) -> None:
    """`--machine X` priced by `cost.instance`: the instance must be a node of X with a device for each rank of a
    node (a p5.4xlarge, one H100, is not the price of an 8-rank H100 node; a p5.48xlarge is not a Gaudi 3's). An
    explicit cost.price_usd_per_hour is the user's price per node, taken as given."""
    key = cfg.cost.instance_key
    if key is None or cfg.cost.price_usd_per_hour is not None:
        return
    from gaudi3_scale.metering.live import find_instance

    instance = find_instance(cfg.cost)  # one not in the catalog: the line that lists the known ones
    fix = f"pick an instance of {machine.kind} or set cost.price_usd_per_hour to the price of one node"
    if instance.accelerator != machine.kind:
        raise ConfigError("cost.instance", f"{cfg.cost.instance} is a node of {instance.accelerator}, but the "
                          f"forecast is of {machine.kind}; {fix}")  # fmt: skip
    ranks = cfg.parallel.nproc_per_node
    if machine.kind != "cpu" and instance.accelerators_per_node < ranks:
        raise ConfigError("cost.instance", f"{cfg.cost.instance} has {instance.accelerators_per_node} "
                          f"{instance.accelerator} per node, but the forecast runs {ranks} ranks per node; pick an "
                          f"instance with at least {ranks}, set parallel.nproc_per_node to at most "
                          f"{instance.accelerators_per_node}, or set cost.price_usd_per_hour to the price of one "
                          "node")  # fmt: skip


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

    cfg = resolve_forecast_config(config_path, overrides, machine, nodes)
    if probe and cfg.parallel.nnodes > 1:
        raise ConfigError("parallel.nnodes", f"{cfg.parallel.nnodes}: --probe runs on this machine, one node; "
                          "probe one node of the layout (--parallel.nnodes 1)")  # fmt: skip
    cfg = _epochs_as_steps(cfg)
    target = machine_for(cfg, machine, refresh_peak=refresh_peak)
    check_runs_on(cfg, target.device_kind)  # a layout the trainer refuses there is not forecast
    if machine is not None:
        _check_instance(cfg, target)
    model = resolved_model(cfg.model, cfg.data)
    measured = None
    if probe:
        from gaudi3_scale.forecast.probe import probe_measured_steps, run_probe

        shape = run_shape(cfg, model, target)
        warmup = cfg.train.resolved_throughput_warmup_steps()
        first_guess = _forecast(cfg, shape, target).step_time_s  # sizes the probe: ~10 s of measured steps
        measured, why = run_probe(
            config_path,
            tuple(overrides),
            shape,
            val_batches=cfg.train.val_batches,
            warmup_steps=max(warmup, 2),
            measured_steps=probe_measured_steps(first_guess),
            spike_policy=cfg.health.spike_policy,
        )
        if measured is None:
            warn(f"--probe: {why}; the forecast comes from the catalog")
        elif target.store is not None:
            target.store.add_probe(measured)
            target = machine_for(cfg, machine)  # its MFU now counts the new probe
    return cfg, _forecast(cfg, run_shape(cfg, model, target), target, probe=measured)


def _epochs_as_steps(cfg: RunConfig) -> RunConfig:
    """`cfg` with train.max_epochs as the optimizer steps `gaudi3 train` resolves it to over the dataset's tokens
    (`train.assembly.steps_of_epochs`, which the trainer runs): a forecast is of the steps the run trains, not of
    the max_steps placeholder beside an epoch count. A config without max_epochs, as it is."""
    if cfg.train.max_epochs is None:
        return cfg
    from gaudi3_scale.data.inputs import open_training_data
    from gaudi3_scale.train.assembly import steps_of_epochs

    tokens_per_step = cfg.batch_plan(cfg.parallel.world_size).tokens_per_step
    train = steps_of_epochs(cfg.train, open_training_data(cfg.data, progress=False),
                            tokens_per_step=tokens_per_step, note=lambda line: None)  # fmt: skip
    return dataclasses.replace(cfg, train=train)


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
    """The forecast `gaudi3 train` records at its start (cheap: no probe; the store's probe of this layout), of the
    steps it trains (train.max_epochs resolved as the trainer resolves it). A
    resumed run's is from its checkpoint's step on, as its summary.json measures it (`forecast_run`). On a CPU the
    peak is measured again, as the trainer measures it for its MFU (one measurement per process), and the store
    keeps it when higher than the one it has: a peak first measured on a busy machine does not slow every later
    forecast."""
    from gaudi3_scale.checkpoint.contents import COST_KEY
    from gaudi3_scale.metering.live import resumed_cost_usd
    from gaudi3_scale.train.resume import resume_manifest

    cfg = _epochs_as_steps(cfg)
    machine = machine_for(cfg, None, measure_peak=True)
    manifest = resume_manifest(cfg) or {}
    step, spent = manifest.get("step"), manifest.get(COST_KEY)
    start = step if isinstance(step, int) and 0 < step < cfg.train.max_steps else 0
    # what the resumed meter starts from: the checkpoint's cost, or what the run recorded after it when more
    checkpoint_usd = float(spent) if isinstance(spent, int | float) else None
    spent_usd = resumed_cost_usd(checkpoint_usd, cfg.output_dir / "metrics.jsonl") if start else None
    return _forecast(cfg, run_shape(cfg, model, machine), machine, start_step=start, spent_usd=spent_usd)
