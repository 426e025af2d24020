"""GaudiTrainer: a run config in, a trained model and its outputs out.

It builds the Lightning `Trainer` from a `RunConfig` (device, precision, accumulation, validation cadence, our
callbacks) and trains either the registry model on the configured dataset or a user's own LightningModule and
DataModule. Outputs land in the run directory:

    config.yaml  metrics.jsonl  checkpoints/step-XXXXXXXX/ + latest  [light_checkpoints/…]  tokenizer/  summary.json
    loss.png

A fit, in order: the device, the model resolved against its dataset and the plans (`train.assembly`); the module
and data; the parts that act after each step (`train.parts`) and the Lightning Trainer around them; the services
beside the fit (`train.services`); the fit; then the summary (`train.summary`, `train.report`), or, after a loss
spike, a rollback (`train.rollback`) and the next fit.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from rich.console import Console

from gaudi3_scale.config.core import save_yaml, to_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data import TokenDataModule
from gaudi3_scale.data.inputs import open_training_data
from gaudi3_scale.data.loader import val_budgets
from gaudi3_scale.data.skips import BatchSkips
from gaudi3_scale.data.tokenizers import Tokenizer
from gaudi3_scale.device import DevicePlan
from gaudi3_scale.distributed.config import STRATEGIES
from gaudi3_scale.distributed.env import launched_rank
from gaudi3_scale.distributed.launch import launched_parallel, stop_with_launcher
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.distributed.strategies import build_strategy
from gaudi3_scale.distributed.teardown import KeptStore, keep_store, leave_process_group, rejoin_process_group
from gaudi3_scale.health.guard import StepGuard
from gaudi3_scale.monitor.trackers import build_trackers
from gaudi3_scale.train.after_step import AfterStep
from gaudi3_scale.train.assembly import (
    launched_world_size,
    plan_run_device,
    quiet_lightning,
    resolve_model,
    steps_of_epochs,
)
from gaudi3_scale.train.callbacks import own_signals
from gaudi3_scale.train.config import RunConfig, build_run_config, per_rank_checkpoints, sharded_by
from gaudi3_scale.train.forecast_file import predicted_fields, read_forecast, write_plan
from gaudi3_scale.train.module import LanguageModel
from gaudi3_scale.train.nodes import NodesCheck
from gaudi3_scale.train.parts import build_after_step
from gaudi3_scale.train.preflight import check_run_inputs, resume_point
from gaudi3_scale.train.report import print_summary, read_kept_summary, read_metrics, write_run_report
from gaudi3_scale.train.resume import check_resume_compatible, check_resume_data, check_resume_semantics
from gaudi3_scale.train.rollback import Rollback, guard_stop, plan_rollback
from gaudi3_scale.train.run_lock import run_directory_lock
from gaudi3_scale.train.services import start_services
from gaudi3_scale.train.step import StepState, step_state_of
from gaudi3_scale.train.step_health import StepHealth
from gaudi3_scale.train.summary import plot_title, run_summary

__all__ = ["GaudiTrainer"]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


# Lightning Trainer arguments the run config decides (`build_trainer` sets them from it): given as keyword
# arguments they would override it after the module's schedule and the run's files were made from the config.
_CONFIG_OWNS = {
    "max_steps": "train.max_steps", "max_epochs": "train.max_steps", "min_steps": "train.max_steps",
    "precision": "train.precision", "devices": "parallel.nproc_per_node", "num_nodes": "parallel.nnodes",
    "strategy": "parallel.strategy", "accelerator": "chosen for this machine's devices",
    "val_check_interval": "train.val_every_steps", "check_val_every_n_epoch": "train.val_every_steps",
    "limit_val_batches": "train.val_batches", "deterministic": "train.deterministic",
    "default_root_dir": "out_dir", "accumulate_grad_batches": "train.global_batch_size and micro_batch_size",
    "gradient_clip_val": "optim.grad_clip_norm", "logger": "monitor.loggers",
    "enable_checkpointing": "the checkpoint section",
}  # fmt: skip


def _warn_val_budget(val_batches: int, weights: list[float], warn: Callable[[str], None]) -> None:
    """A mixture with more weighted members than `train.val_batches` validates one batch of each (`val_budgets`)."""
    total = sum(val_budgets(val_batches, weights))
    if total > val_batches:
        warn(f"train.val_batches={val_batches} is fewer than the {total} data.mixture members with a weight: "
             f"validating on {total} batches, one of each member (set train.val_batches to {total} or more)")  # fmt: skip


def _run_config(config: object) -> RunConfig:
    """The trainer's config: a RunConfig, a YAML file's path (`build_run_config`), or None for the defaults."""
    if config is None:
        return RunConfig()
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, str | os.PathLike):
        return build_run_config(Path(config))
    # named by its type: the value itself goes no further than this module (tests/unit/test_config_walk.py)
    hint = "; a mapping of fields: build_run_config(base=...)" if isinstance(config, Mapping) else ""
    raise UserInputError(
        f"GaudiTrainer takes a RunConfig or a config file's path, got a {type(config).__name__}{hint}"
    )


def _check_own_module(model: pl.LightningModule | None, cfg: RunConfig) -> None:
    """Pipeline stages are cut from the registry model (`distributed.pipeline`): a user's own module under
    `parallel.pp_size` > 1 would get a mesh with a pipeline dimension and nothing that splits or synchronises it
    (each rank training its own copy). Tensor parallel and HSDP stay allowed: Lightning's ModelParallelStrategy
    hands the module its device mesh in `configure_model`, where a module of one's own applies them."""
    pp_size = cfg.parallel.pp_size
    if model is None or isinstance(model, LanguageModel) or pp_size <= 1:
        return
    raise ConfigError(
        "parallel.pp_size",
        f"{pp_size} splits the registry model (model.name) into pipeline stages; a module of your own "
        f"({type(model).__name__}) trains without stages, under parallel.strategy "
        f"{', '.join(STRATEGIES)}; set parallel.pp_size 1",
    )


def _check_module(model: object, datamodule: object) -> None:
    """A model and datamodule of Lightning's `lightning.pytorch` namespace, the one the trainer runs."""
    for what, value, base in (
        ("model", model, pl.LightningModule),
        ("datamodule", datamodule, pl.LightningDataModule),
    ):
        if value is None or isinstance(value, base):
            continue
        name = type(value).__name__
        other = sys.modules.get("pytorch_lightning")
        if other is not None and isinstance(value, getattr(other, base.__name__)):
            raise UserInputError(
                f"GaudiTrainer.fit: {what} {name} derives from pytorch_lightning.{base.__name__}, but the trainer "
                f"runs lightning.pytorch; subclass lightning.pytorch.{base.__name__} instead"
            )
        raise UserInputError(
            f"GaudiTrainer.fit: {what} must be a lightning.pytorch.{base.__name__}, got {name}"
        )


class _AfterRestore(pl.Callback):
    """Calls `write` once the fit has restored its checkpoint: Lightning restores the module, optimizer and loops
    before `on_train_start`."""

    def __init__(self, write: Callable[[], None]) -> None:
        self.write = write

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write()


class GaudiTrainer:
    """Train from a `RunConfig`; `fit()` returns the run summary (also written to `summary.json`).

    Pass `model`/`datamodule` to `fit` to train your own LightningModule with the same devices, precision,
    checkpointing and metrics. A module that sets `tokens_per_step` and `flops_per_token` also gets tokens/s and
    MFU (`train.step.step_state_of`).

    With a `cost` price the run's cost is tracked live (`metering.live`); a run that reaches `cost.budget_usd` or is
    paused by the spot policy checkpoints and stops, with `stop_exit_code` 3 or 4 in the summary, and `fit` raises
    `BudgetExhaustedError` instead of resuming a checkpoint that has already spent the budget.

    A multi-rank `fit` ends by destroying the process group it made, so that no rank exits with gloo's threads still
    up: `trainer` and `module` are released with it (None afterwards; the checkpoint holds the trained state). A
    group the caller initialised before `fit` is the caller's: the fit runs in it and leaves it (and them) up.

    A run holds its output directory for as long as `fit` runs (`train.run_lock`): a second run there is refused
    with `RunDirectoryBusyError`. Inside a launcher's worker (torchrun) the launch geometry comes from the launcher
    when the config leaves it at one process (`distributed.launch.launched_parallel`).

    Other keyword arguments go to Lightning's `Trainer`; those the run config decides (`max_steps`, `precision`,
    `devices`, `strategy`, ...) are refused with one line naming the config field to set instead.
    """

    def __init__(
        self,
        config: RunConfig | str | os.PathLike[str] | None = None,
        *,
        callbacks: list[pl.Callback] | None = None,
        progress: bool = True,
        console: Console | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        config = _run_config(config)
        parallel = launched_parallel(config.parallel)
        self.config = (
            config if parallel is config.parallel else dataclasses.replace(config, parallel=parallel)
        )
        self.extra_callbacks = list(callbacks or [])
        self.progress = progress
        self.console = console or Console(stderr=True)
        for key in trainer_kwargs:
            if key in _CONFIG_OWNS:
                raise UserInputError(
                    f"GaudiTrainer: {key}= is the run config's to set ({_CONFIG_OWNS[key]}): the optimizer's "
                    "schedule, the checkpoints and config.yaml follow the config; set it there"
                )
        self.trainer_kwargs = trainer_kwargs
        self.trainer: pl.Trainer | None = None
        self.module: pl.LightningModule | None = None
        self.datamodule: pl.LightningDataModule | None = None
        self.device_plan: DevicePlan | None = None
        # The run's parts after each step (metrics, checkpoint, stop, cost, health, watchdog): built with the trainer.
        self._after: AfterStep | None = None
        self._forecast: dict[str, Any] | None = (
            None  # `gaudi3 plan`'s forecast of this run (train.forecast_file)
        )
        self._guard: StepGuard | None = None  # the step guard of our own model (health.guard)
        # this fit resumes a checkpoint at train.max_steps: it trains nothing, and leaves the run's outputs as they are
        self._finished = False
        self._health: StepHealth | None = None
        # The prepared tokens' identity (data.manifest.tokens_sha256): the registry model on our data only.
        self._data_sha256: str | None = None
        self._tokenizer: Tokenizer | None = None  # the run's dataset's, saved beside its config
        self._resolved_plans: tuple[BatchPlan, ParallelPlan] | None = None
        # health.spike_policy rollback: the data steps the run's rollbacks skip, a multi-rank fit's store kept for
        # the re-fit after one, and the re-fits made
        self._rollback_skips: list[int] = []
        self._kept_store: KeptStore | None = None
        self._refits = 0
        # A process group that was up before fit() started is the caller's: the fit runs in it and leaves it up.
        self._callers_group = False

    @property
    def out_dir(self) -> Path:
        return self.config.output_dir

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is rank 0 of the run (also after a multi-rank fit has released the trainer)."""
        return launched_rank() == 0

    # ---- what the run trains on, and where -------------------------------------------------------------------
    def _plan_device(self) -> DevicePlan:
        """Threads, device and precision (`train.assembly.plan_run_device`), resolved once."""
        if self.device_plan is None:
            cfg = self.config
            # a sharded run cannot train in 16-mixed (refused by the config): `auto` is 32-true on a GPU without bf16
            self.device_plan = plan_run_device(
                cfg.train, nproc_per_node=cfg.parallel.nproc_per_node, fp16=sharded_by(cfg.parallel) is None
            )
        return self.device_plan

    def _plans(self) -> tuple[BatchPlan, ParallelPlan]:
        """The run's batch and parallel plans, resolved once for this launch (see `distributed.plan`)."""
        if self._resolved_plans is None:
            world, device = launched_world_size(self.config.parallel), self._plan_device()
            self._resolved_plans = (
                self.config.batch_plan(world),
                self.config.parallel_plan(
                    world,
                    float8=device.float8,
                    bf16_mixed=device.precision.startswith("bf16-mixed"),
                    accelerator=device.accelerator,
                ),
            )
        return self._resolved_plans

    def _build_default(self, resume_from: Path | None) -> tuple[LanguageModel, TokenDataModule]:
        """The registry model on the run's dataset. The config from here on holds what the data resolved: the
        model's vocabulary and padding, and train.max_epochs as max_steps."""
        cfg = self.config
        prepared = open_training_data(cfg.data, progress=self.progress)
        self._data_sha256 = prepared.tokens_sha256
        model_cfg, masking = resolve_model(cfg.model, prepared, cfg.data, seed=cfg.seed, resume_from=resume_from,
                                           accelerator=self._plan_device().accelerator,
                                           tp_size=cfg.parallel.tp_size)  # fmt: skip
        batch, parallel = self._plans()
        train = steps_of_epochs(cfg.train, prepared, tokens_per_step=batch.tokens_per_step, note=self._note)
        self.config = cfg = dataclasses.replace(cfg, model=model_cfg, train=train)
        init_from = None if resume_from is not None else model_cfg.init_from  # resuming: the checkpoint wins
        module = LanguageModel(model_cfg, cfg.optim, max_steps=train.max_steps, batch=batch, parallel=parallel,
                               seed=cfg.seed, init_from=init_from)  # fmt: skip
        # Batches that make no update: the stream's and the guard's (a checkpoint's own join them on resume).
        skips = BatchSkips([*cfg.health.skip_batches, *self._rollback_skips])
        datamodule = TokenDataModule(
            prepared, context_length=model_cfg.context_length, global_batch_size=batch.global_batch_size,
            micro_batch_size=batch.micro_batch_size, seed=cfg.seed, val_batches=train.val_batches,
            loader_workers=cfg.data.loader_workers, tp_size=parallel.tp_size, pp_size=parallel.pp_size,
            prefetch_shards=cfg.data.prefetch_shards, masking=masking, skips=skips,
            allow_data_change=train.allow_data_change,
        )  # fmt: skip
        _warn_val_budget(train.val_batches, [m.weight for m in prepared.members], self._warn)
        guard = StepGuard(cfg.health, skips)
        if guard.active:
            module.guard = self._guard = guard
        self._tokenizer = prepared.tokenizer  # saved with the config once the resume checks passed
        return module, datamodule

    # ---- the Lightning trainer around the parts that act after each step ---------------------------------------
    def build_trainer(self, state: StepState) -> pl.Trainer:
        """The Lightning Trainer for a module whose steps write `state` (the step contract): the run's strategy,
        precision and checkpoint IO, and `AfterStep`, which does everything that follows a step."""
        cfg, plan = self.config.train, self._plan_device()
        batch, parallel = self._plans()
        strategy = build_strategy(parallel, batch, accelerator=plan.accelerator,
                                  grad_clip_norm=self.config.optim.grad_clip_norm, hidden_size=self.config.model.dim,
                                  collective_timeout_s=self.config.health.collective_timeout_s)  # fmt: skip
        after, self._health = build_after_step(
            self.config, state, strategy=strategy, parallel=parallel, device=plan, guard=self._guard,
            data_sha256=self._data_sha256, our_model=isinstance(self.module, LanguageModel), rank=launched_rank(),
            console=self.console, progress=self.progress, warn=self._warn, note=self._note, tokenizer=self._tokenizer,
        )  # fmt: skip
        self._after = after
        # monitor.loggers; None when unnamed
        trackers = build_trackers(self.config.monitor, run_name=self.config.name, hyperparameters=to_dict(self.config),
                                  out_dir=self.out_dir, metrics=after.metrics, warn=self._warn)  # fmt: skip
        # Our datamodule's loaders already hold this data-parallel rank's share (the train stream and the val set):
        # Lightning's DistributedSampler would split the val set again, and its limit would cut a mixture's last
        # members; a caller's own datamodule keeps Lightning's defaults.
        own_data = isinstance(self.datamodule, TokenDataModule)
        kwargs: dict[str, Any] = {
            "accelerator": plan.accelerator, "devices": self.config.parallel.nproc_per_node,
            "num_nodes": self.config.parallel.nnodes, "strategy": strategy, "max_steps": cfg.max_steps,
            # Lightning counts batches: an optimizer step is `accumulation` of them for the module's own loop.
            "val_check_interval": cfg.val_every_steps * state.accumulation if cfg.val_every_steps else None,
            "check_val_every_n_epoch": None, "num_sanity_val_steps": 0, "use_distributed_sampler": not own_data,
            "limit_val_batches": 1.0 if own_data else cfg.val_batches,
            "logger": trackers.loggers if trackers is not None else False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "deterministic": cfg.deterministic,
            "default_root_dir": str(self.out_dir),
            "callbacks": [after, *([trackers] if trackers else []), *self.extra_callbacks],
            "plugins": [after.checkpoint.checkpointer.io],
        }  # fmt: skip
        if plan.accelerator == "hpu":
            # Lightning's own "bf16-mixed" autocasts on cuda; on Gaudi the plugin autocasts on hpu.
            # (hpu plans only hold bf16-mixed, bf16-true or 32-true: the plugin's Literal.)
            from gaudi3_scale.device.precision import GaudiMixedPrecision

            kwargs["plugins"].append(GaudiMixedPrecision(plan.precision))  # type: ignore[arg-type]
        else:
            kwargs["precision"] = plan.precision
        kwargs.update(self.trainer_kwargs)
        trainer = pl.Trainer(**kwargs)
        own_signals(trainer, after.stop)
        return trainer

    # ---- the fit -----------------------------------------------------------------------------------------------
    def fit(
        self, model: pl.LightningModule | None = None, datamodule: pl.LightningDataModule | None = None
    ) -> dict[str, Any]:
        started = time.perf_counter()
        _check_module(model, datamodule)
        _check_own_module(model, self.config)  # before anything is built or written
        self._callers_group = _distributed()
        quiet_lightning()
        self._plan_device()  # a missing accelerator first
        check_run_inputs(self.config)  # one line before any data work (train.preflight)
        stop_with_launcher()  # a rank of a launcher that dies stops (and saves) instead of training on alone
        with run_directory_lock(self.out_dir, node_rank=self.config.parallel.node_rank):
            # what `gaudi3 train` predicted (train.forecast_file), if anything; plan.json is written once the run
            # is past its refusals (`_fit_once`), so the dashboard can draw it while the run trains
            self._forecast = read_forecast()
            return self._fit(model, datamodule, started)

    def _fit(
        self, model: pl.LightningModule | None, datamodule: pl.LightningDataModule | None, started: float
    ) -> dict[str, Any]:
        """Fit; after a spike that asks for a rollback (`train.rollback`), fit again in this process from the
        checkpoint it restores, with its batches skipped, until a fit ends without one."""
        # refused before any data work or file written
        ckpt_path = resume_point(self.config, warn=self._warn, own_model=model is None)
        rollback: Rollback | None = None
        while True:
            outcome = self._fit_once(model, datamodule, ckpt_path, started, rollback)
            if not isinstance(outcome, Rollback):
                return outcome
            rollback = outcome
            ckpt_path, model, datamodule = rollback.checkpoint, None, None

    def _fit_once(
        self,
        model: pl.LightningModule | None,
        datamodule: pl.LightningDataModule | None,
        ckpt_path: Path | None,
        started: float,
        rollback: Rollback | None,
    ) -> dict[str, Any] | Rollback:
        """One Lightning fit: the run's summary, or the rollback planned when a spike ended it."""
        previous_guard, previous_health = self._guard, self._health
        previous_cost = self._after.cost if self._after is not None else None
        model, datamodule = self._assemble(model, datamodule, ckpt_path)
        if rollback is not None and previous_guard is not None and self._guard is not None:
            self._guard.carry_from(previous_guard, lr_scale=self.config.health.rollback_lr_scale)
        trainer = self.trainer = self.build_trainer(step_state_of(model))
        assert self._after is not None, "build_trainer builds the run's parts"
        if self.config.parallel.nnodes > 1:  # every node sees --out and resumes from the same checkpoint
            cfg = self.config
            nodes = NodesCheck(self.out_dir, ckpt_path, per_rank_files=per_rank_checkpoints(cfg.parallel),
                               remote_url=cfg.checkpoint.remote_url, checkpoints=cfg.checkpoint.enabled)  # fmt: skip
            trainer.callbacks.insert(0, nodes)  # type: ignore[attr-defined]  # set by its connector
        if rollback is not None and previous_cost is not None and self._after.cost is not None:
            self._after.cost.carry_from(previous_cost)  # the checkpoint restores the training, not the spend
        self._after.metrics.started_s = started  # records say when (wall_s), on summary.json's clock
        finished = self._finished = ckpt_path is not None and self._check_resume(model, ckpt_path)
        # the run's files and plan.json past every refusal: a run refused at its start changes nothing, nor does
        # one whose checkpoint is at train.max_steps already (it trains nothing; its config.yaml stays the one
        # the checkpoint was trained with). A resume writes them once Lightning has restored the checkpoint: one
        # that fails to load leaves the config.yaml its checkpoints were trained with.
        config = not (finished and (self.out_dir / "config.yaml").exists())
        if ckpt_path is not None and not finished:
            after_restore = _AfterRestore(lambda: self._write_run_start(rollback, config=config))
            trainer.callbacks.append(after_restore)  # type: ignore[attr-defined]  # set by its connector
        else:
            self._write_run_start(rollback, config=config)
        if rollback is not None and self._health is not None:  # reported at the first step of this fit
            if previous_health is not None:
                self._health.events[:0] = previous_health.events
            self._health.queued.append((rollback.record(), rollback.line()))
        with self._services(trainer):
            self._rejoin_process_group()
            trainer.fit(model, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
        guard = self._guard
        outcome: dict[str, Any] | Rollback
        # a stop signal that arrived while the spike ended the fit wins: the run stops (the newest checkpoint before
        # the spike is the resume point; the resumed run meets the spike again and rolls back then)
        if (
            guard is not None
            and guard.rollback_at is not None
            and not self._after.stop.adopt_pending(trainer)
        ):
            outcome = self._plan_rollback(guard, guard.rollback_at)
        else:
            outcome = self._summary(trainer, datamodule, started)
        del trainer, model  # what holds the group goes with it (`_release_fit`)
        self._release_fit(datamodule)
        return outcome

    def _assemble(
        self,
        model: pl.LightningModule | None,
        datamodule: pl.LightningDataModule | None,
        ckpt_path: Path | None,
    ) -> tuple[pl.LightningModule, pl.LightningDataModule | None]:
        """What this fit trains: the registry model on the run's dataset unless given."""
        # Python, numpy and torch global generators: nothing in our training draws from them (weights, data order
        # and dropout have their own seeded streams), but user code may, and checkpoints record them, so two runs
        # with the same seed must hold the same state. One stream per rank.
        pl.seed_everything(self.config.seed + launched_rank(), workers=False, verbose=False)
        if model is None:
            if datamodule is not None:
                raise UserInputError(
                    "GaudiTrainer.fit: pass a datamodule together with your own model, or neither"
                )
            model, datamodule = self._build_default(ckpt_path)
        elif self.config.train.max_epochs is not None:
            raise ConfigError(
                "train.max_epochs",
                "counts passes over the run's own dataset; with your own model and datamodule set train.max_steps",
            )
        self.module, self.datamodule = model, datamodule
        return model, datamodule

    def _write_run_start(self, rollback: Rollback | None, *, config: bool) -> None:
        """config.yaml and the tokenizer (`config`), and (the first fit of a run that trains) plan.json."""
        if config:
            self._write_run_files()
        if rollback is None and self._forecast is not None and launched_rank() == 0 and not self._finished:
            write_plan(self.out_dir, self._forecast)

    def _write_run_files(self) -> None:
        """The run's config and (the run's own dataset) tokenizer, written once the run is past its refusals: a
        resume refused at its start changes nothing in the run directory."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if launched_rank() == 0:
            save_yaml(self.config, self.out_dir / "config.yaml")
            if self._tokenizer is not None:
                tokenizer_dir = self.out_dir / "tokenizer"
                tokenizer_dir.mkdir(parents=True, exist_ok=True)
                self._tokenizer.save(tokenizer_dir)

    def _check_resume(self, model: pl.LightningModule, ckpt_path: Path) -> bool:
        """The checkpoint's model and data against this run's (`train.resume`): our model only. True when the
        checkpoint is at `train.max_steps` already."""
        finished = False
        if isinstance(model, LanguageModel):
            step = check_resume_compatible(ckpt_path, to_dict(self.config))
            finished = step is not None and step == self.config.train.max_steps
            allow_change = self.config.train.allow_data_change
            check_resume_data(ckpt_path, self._data_sha256, allow_change=allow_change, warn=self._warn)
            check_resume_semantics(ckpt_path, self._warn)
        if self.progress:
            self.console.print(f"resuming from {ckpt_path}")
        return finished

    def _services(self, trainer: pl.Trainer) -> ExitStack:
        """What runs beside the fit (`train.services`), stopped when the fit ends."""
        assert self._after is not None, "build_trainer builds the run's parts"
        cfg = self.config
        return start_services(self._after, monitor=cfg.monitor, train=cfg.train, run_name=cfg.name,
                              out_dir=self.out_dir, device=trainer.strategy.root_device,
                              accelerator=self._plan_device().accelerator, warn=self._warn,
                              predicted=predicted_fields(self._forecast))  # fmt: skip

    def _summary(
        self, trainer: pl.Trainer, datamodule: pl.LightningDataModule | None, started: float
    ) -> dict[str, Any]:
        """The run's summary (`train.summary`); rank 0 writes it and loss.png, and prints it."""
        assert self._after is not None, "build_trainer builds the run's parts"
        cfg, records = self.config, read_metrics(self.out_dir / "metrics.jsonl")
        summary = run_summary(self._after, trainer, records=records, wall_s=time.perf_counter() - started,
                              run_name=cfg.name, model=cfg.model, device_plan=self.device_plan, health=self._health,
                              warn=self._warn)  # fmt: skip
        summary.update(predicted_fields(self._forecast))
        if (guard := self._guard) is not None and guard.stop_at is not None:
            summary.update(guard_stop(guard))
        if isinstance(datamodule, TokenDataModule) and datamodule.has_data:
            cache = datamodule.data.stats()  # a URL dataset's shard cache, this process's handle
            if cache:
                summary["data_cache"] = cache
        if trainer.is_global_zero:
            finished = self._finished
            kept = (
                read_kept_summary(self.out_dir, summary, max_steps=cfg.train.max_steps) if finished else None
            )
            if (
                kept is not None
            ):  # nothing trained: the run's summary, loss.png and plan.json stay; shown as they are
                summary = kept
                if self.progress:
                    print_summary(summary, self.console)
            else:
                write_run_report(self.out_dir, summary, records, title=plot_title(cfg.name, cfg.model.name),
                                 console=self.console if self.progress else None)  # fmt: skip
        return summary

    # ---- rollback and the process group ------------------------------------------------------------------------
    def _plan_rollback(self, guard: StepGuard, spike_step: int) -> Rollback:
        """The rollback from the spike at `spike_step`, its batches added to the run's skips (`train.rollback`); a
        multi-rank fit keeps its store for the ranks to form their group again in the next fit."""
        assert self._after is not None, "build_trainer builds the run's parts"
        health = self.config.health
        if _distributed():
            # Rank 0 commits the checkpoints (an async save's commit ends with its services): every rank reads the
            # committed list only after that, so all of them restore the same one.
            torch.distributed.barrier()
        rollback = plan_rollback(
            self._after.checkpoint.manager,
            spike_step=spike_step,
            skips=guard.skips,
            global_batch_size=self._plans()[0].global_batch_size,
            skip_batches=health.rollback_skip_batches,
            lr_scale=guard.lr_scale * health.rollback_lr_scale,
            warn=self._warn,
        )
        self._rollback_skips.extend(rollback.skipped)
        if _distributed() and not self._callers_group:
            self._kept_store = keep_store()
        return rollback

    def _rejoin_process_group(self) -> None:
        """A re-fit after a rollback: the ranks form their group again, on the store the last fit kept."""
        if self._kept_store is None:
            return
        self._refits += 1
        timeout_s = self.config.health.collective_timeout_s
        rejoin_process_group(self._kept_store, attempt=self._refits, timeout_s=timeout_s)
        self._kept_store = None

    def _release_fit(self, datamodule: pl.LightningDataModule | None) -> None:
        """Lightning leaves the group up. Ours goes now, with the fitted trainer and module (the caller dropped its
        own), so that its gloo threads are joined before the process exits (`distributed.teardown`). Their
        parameters are shards or replicas whose collectives are gone; the checkpoint holds the trained state. A
        later fit() makes a new group. A group the caller made before fit() stays up, and with it the trainer and
        module (the caller's collectives go on in it)."""
        if not _distributed() or self._callers_group:
            return
        assert self.trainer is not None
        for callback in self.trainer.callbacks:  # type: ignore[attr-defined]
            # Lightning binds the module's log functions onto every callback and never unbinds them; our callbacks
            # and the caller's outlive the fit and would keep the module.
            for name in ("log", "log_dict"):
                vars(callback).pop(name, None)
        if datamodule is not None:
            datamodule.trainer = None  # Lightning's back-reference: datamodule → trainer → strategy → model
        self.trainer = self.module = None
        left = leave_process_group()
        if left:
            self.console.print(
                f"[yellow]warning:[/yellow] rank {launched_rank()}: {left} gloo worker threads are still up after"
                " the process group was destroyed: something outside the run holds a group (a model passed to fit?);"
                " release it before the process exits, or the rank may abort at exit",
                highlight=False,
                soft_wrap=True,
            )

    def _warn(self, message: str) -> None:
        if launched_rank() == 0:
            self.console.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)

    def _note(self, message: str) -> None:
        if launched_rank() == 0:
            self.console.print(message, highlight=False, soft_wrap=True)
