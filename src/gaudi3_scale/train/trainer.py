"""GaudiTrainer: a run config in, a trained model and its outputs out.

It builds the Lightning `Trainer` from a `RunConfig` (device, precision, accumulation, validation cadence, our
callbacks) and trains either the registry model on the configured dataset or a user's own LightningModule and
DataModule. Outputs land in the run directory:

    config.yaml  metrics.jsonl  checkpoints/step-XXXXXXXX/ + latest  [light_checkpoints/…]  tokenizer/  summary.json
    loss.png
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from rich.console import Console

from gaudi3_scale.checkpoint.checkpointer import Checkpointer
from gaudi3_scale.checkpoint.contents import CONFIG_KEY, HEALTH_KEY, RNG_KEY, FixedState
from gaudi3_scale.config.core import config_sha256, save_yaml, to_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data import TokenDataModule
from gaudi3_scale.data.inputs import TrainingData, open_training_data
from gaudi3_scale.data.mlm import MlmMasking, mlm_vocabulary
from gaudi3_scale.data.skips import BatchSkips
from gaudi3_scale.device import DevicePlan, plan_device
from gaudi3_scale.distributed.launch import launched_parallel, signal_exit_code, stop_with_launcher
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.distributed.strategies import build_strategy, saves_sharded
from gaudi3_scale.distributed.teardown import (
    KeptStore,
    keep_store,
    leave_process_group,
    rejoin_process_group,
)
from gaudi3_scale.health.guard import StepGuard
from gaudi3_scale.health.heartbeat import HEALTH_DIR
from gaudi3_scale.health.stragglers import StragglerDetector
from gaudi3_scale.models import ModelConfig
from gaudi3_scale.models.counting import check_parameter_count
from gaudi3_scale.monitor.perf import mfu, mfu_above_peak
from gaudi3_scale.monitor.trackers import build_trackers
from gaudi3_scale.train.after_step import AfterStep
from gaudi3_scale.train.callbacks import GracefulInterrupt, StepCheckpoint
from gaudi3_scale.train.config import RunConfig, TrainConfig, steps_for_epochs
from gaudi3_scale.train.cost_callback import LiveCost, build_live_cost
from gaudi3_scale.train.module import LanguageModel
from gaudi3_scale.train.preflight import check_run_inputs, resume_point
from gaudi3_scale.train.report import plot_loss, print_summary, read_metrics, write_summary
from gaudi3_scale.train.resume import (
    check_resume_compatible,
    check_resume_data,
    saved_run_config,
)
from gaudi3_scale.train.rng import RngStates
from gaudi3_scale.train.rollback import Rollback, plan_rollback
from gaudi3_scale.train.run_lock import run_directory_lock
from gaudi3_scale.train.spot import SpotInterruptionWatcher
from gaudi3_scale.train.step import StepState, step_state_of
from gaudi3_scale.train.step_health import StepHealth
from gaudi3_scale.train.step_metrics import RichStepProgress, RunMetrics

if TYPE_CHECKING:
    from gaudi3_scale.health.watchdog import Watchdog
    from gaudi3_scale.monitor.prometheus import MetricsEndpoint

__all__ = ["GaudiTrainer"]


def _quiet_lightning() -> None:
    """Our progress bar and summary replace Lightning's banner lines ("GPU available…", tips)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    # Lightning 2.6 calls a pytree API that torch 2.13 deprecates; not ours to fix, and not actionable for users.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)
    # DeepSpeed calls collectives torch 2.13 renamed, once per bucket: hundreds of identical lines per step.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )


def _global_rank() -> int:
    """Rank from the launcher's environment (the Lightning trainer does not exist yet when files are written)."""
    return int(os.environ.get("RANK", "0"))


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


class GaudiTrainer:
    """Train from a `RunConfig`; `fit()` returns the run summary (also written to `summary.json`).

    Pass `model`/`datamodule` to `fit` to train your own LightningModule with the same devices, precision,
    checkpointing and metrics. A module that sets `tokens_per_step` and `flops_per_token` also gets tokens/s and
    MFU (`train.step.step_state_of`).

    With a `cost` price the run's cost is tracked live (`metering.live`); a run that reaches `cost.budget_usd` or is
    paused by the spot policy checkpoints and stops, with `stop_exit_code` 3 or 4 in the summary, and `fit` raises
    `BudgetExhaustedError` instead of resuming a checkpoint that has already spent the budget.

    A multi-rank `fit` ends by destroying the process group, so that no rank exits with gloo's threads still up:
    `trainer` and `module` are released with it (None afterwards; the checkpoint holds the trained state).

    A run holds its output directory for as long as `fit` runs (`train.run_lock`): a second run there is refused
    with `RunDirectoryBusyError`. Inside a launcher's worker (torchrun) the launch geometry comes from the launcher
    when the config leaves it at one process (`distributed.launch.launched_parallel`).
    """

    def __init__(
        self,
        config: RunConfig | None = None,
        *,
        callbacks: list[pl.Callback] | None = None,
        progress: bool = True,
        console: Console | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        config = config or RunConfig()
        parallel = launched_parallel(config.parallel)
        self.config = (
            config if parallel is config.parallel else dataclasses.replace(config, parallel=parallel)
        )
        self.extra_callbacks = list(callbacks or [])
        self.progress = progress
        self.console = console or Console(stderr=True)
        self.trainer_kwargs = trainer_kwargs
        self.trainer: pl.Trainer | None = None
        self.module: pl.LightningModule | None = None
        self.datamodule: pl.LightningDataModule | None = None
        self.device_plan: DevicePlan | None = None
        self._live_cost: LiveCost | None = None
        self._guard: StepGuard | None = None  # the step guard of our own model (health.guard)
        self._health: StepHealth | None = None
        self._stragglers: StragglerDetector | None = None  # health.stragglers, fed by RunMetrics
        # The prepared tokens' identity (data.manifest.tokens_sha256): the registry model on our data only.
        self._data_sha256: str | None = None
        self._resolved_plans: tuple[BatchPlan, ParallelPlan] | None = None
        self._step_state = StepState()  # the fitted module's (train.step), from fit()
        self._watchdog: Watchdog | None = None  # health.watchdog: built with the trainer, started by fit()
        # health.spike_policy rollback: the data steps the run's rollbacks skip, a multi-rank fit's store kept for
        # the re-fit after one, and the re-fits made
        self._rollback_skips: list[int] = []
        self._kept_store: KeptStore | None = None
        self._refits = 0

    @property
    def out_dir(self) -> Path:
        return self.config.output_dir

    def _build_default(self, resume_from: Path | None) -> tuple[LanguageModel, TokenDataModule]:
        cfg = self.config
        prepared = open_training_data(cfg.data, progress=self.progress)
        self._data_sha256 = prepared.tokens_sha256
        vocab, masking = prepared.vocab_size, None
        if (
            cfg.model.arch == "bert"
        ):  # MLM: special tokens after the text vocabulary, batches masked (data.mlm)
            mlm = mlm_vocabulary(prepared.tokenizer)
            vocab, masking = mlm.vocab_size, MlmMasking(mlm, cfg.data.mlm_mask_rate, cfg.seed)
        if (
            cfg.model.init_from is not None
            and cfg.model.vocab_size is not None
            and cfg.model.vocab_size < vocab
        ):
            raise ConfigError(
                "model.init_from",
                f"{cfg.model.init_from} has a vocabulary of {cfg.model.vocab_size} tokens but the dataset's "
                f"tokenizer {vocab}; allowed: data prepared with its tokenizer (leave data.tokenizer unset)",
            )
        if cfg.model.vocab_size is None:
            model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab)
        elif cfg.model.vocab_size < vocab:
            raise ConfigError(
                "model.vocab_size",
                f"must be >= the dataset's vocabulary ({vocab}), got {cfg.model.vocab_size}",
            )
        else:
            model_cfg = cfg.model
        model_cfg = self._resolve_padding(model_cfg, resume_from)
        check_parameter_count(model_cfg, "model")  # before anything is written or built
        self.config = cfg = dataclasses.replace(cfg, model=model_cfg, train=self._steps_of_epochs(prepared))
        batch, parallel = self._plans()
        module = LanguageModel(
            model_cfg,
            cfg.optim,
            max_steps=cfg.train.max_steps,
            batch=batch,
            parallel=parallel,
            seed=cfg.seed,
            init_from=None
            if resume_from is not None
            else model_cfg.init_from,  # resuming: the checkpoint wins
        )
        # Batches that make no update: the stream's and the guard's (a checkpoint's own join them on resume).
        skips = BatchSkips([*cfg.health.skip_batches, *self._rollback_skips])
        datamodule = TokenDataModule(
            prepared,
            context_length=model_cfg.context_length,
            global_batch_size=batch.global_batch_size,
            micro_batch_size=batch.micro_batch_size,
            seed=cfg.seed,
            val_batches=cfg.train.val_batches,
            loader_workers=cfg.data.loader_workers,
            tp_size=parallel.tp_size,
            prefetch_shards=cfg.data.prefetch_shards,
            masking=masking,
            skips=skips,
        )
        guard = StepGuard(cfg.health, skips)
        if guard.active:
            module.guard = self._guard = guard
        if _global_rank() == 0:
            tokenizer_dir = self.out_dir / "tokenizer"
            tokenizer_dir.mkdir(parents=True, exist_ok=True)
            prepared.tokenizer.save(tokenizer_dir)
        return module, datamodule

    def _steps_of_epochs(self, prepared: TrainingData) -> TrainConfig:
        """`train.max_epochs` as optimizer steps over this dataset (all members' training tokens): the config from
        here on, the saved one included, says max_steps (and max_epochs null), as if the user had set it."""
        train = self.config.train
        if train.max_epochs is None:
            return train
        train_tokens = sum(int(sum(m.train.shard_tokens)) for m in prepared.members)
        tokens_per_step = self.config.batch_plan(self._world_size()).tokens_per_step
        steps = steps_for_epochs(train.max_epochs, train_tokens=train_tokens, tokens_per_step=tokens_per_step)
        self._note(
            f"train.max_epochs {train.max_epochs}: {steps} optimizer steps ({train_tokens:,} training tokens, "
            f"{tokens_per_step:,} per step)"
        )
        return dataclasses.replace(train, max_steps=steps, max_epochs=None)

    def _plans(self) -> tuple[BatchPlan, ParallelPlan]:
        """The run's batch and parallel plans, resolved once for this launch (see `distributed.plan`)."""
        if self._resolved_plans is None:
            world, device = self._world_size(), self._plan_device()
            self._resolved_plans = (
                self.config.batch_plan(world),
                self.config.parallel_plan(
                    world, float8=device.float8, bf16_mixed=device.precision.startswith("bf16-mixed")
                ),
            )
        return self._resolved_plans

    def _resolve_padding(self, model_cfg: ModelConfig, resume_from: Path | None) -> ModelConfig:
        """Vocabulary padding left null: the checkpoint's when resuming (its weights have that many rows, whatever
        device resumes them), else the device default (`ModelConfig.resolve_padding`); under tensor parallel the
        padded rows must split over the tensor-parallel ranks."""
        tp = self.config.parallel.tp_size
        if model_cfg.pad_vocab_to_multiple is None and resume_from is not None:
            saved = (saved_run_config(resume_from) or {}).get("model", {}).get("pad_vocab_to_multiple")
            if saved is not None:
                model_cfg = dataclasses.replace(model_cfg, pad_vocab_to_multiple=saved)
        resolved = model_cfg.resolve_padding(self._plan_device().accelerator, tp_size=tp)
        if resolved.padded_vocab_size % tp:
            raise ConfigError(
                "model.pad_vocab_to_multiple",
                f"the padded vocabulary ({resolved.padded_vocab_size} rows) must split evenly over parallel.tp_size "
                f"{tp} (tensor parallel shards the embedding and head by rows); allowed: a multiple of {tp}",
            )
        return resolved

    def _plan_device(self) -> DevicePlan:
        """Threads, device and precision; run first, so a missing accelerator fails before any data work."""
        if self.device_plan is None:
            cfg = self.config.train
            threads = cfg.threads or max(1, _default_threads() // self.config.parallel.nproc_per_node)
            torch.set_num_threads(threads)
            # Lightning's process launchers reset the thread count unless OMP_NUM_THREADS is set; ours wins.
            os.environ["OMP_NUM_THREADS"] = str(threads)
            if cfg.hpu_graphs:
                os.environ.setdefault("PT_HPU_LAZY_MODE", "1")  # HPU graphs run in lazy mode only
            self.device_plan = plan_device(cfg.device, cfg.precision, threads=threads)
            accelerator = self.device_plan.accelerator
            if cfg.hpu_graphs and accelerator != "hpu":
                raise ConfigError(
                    "train.hpu_graphs",
                    f"needs Intel Gaudi (train.device hpu), but this run trains on {accelerator}",
                )
            if cfg.compile_mode == "reduce-overhead" and accelerator != "cuda":
                raise ConfigError(
                    "train.compile_mode",
                    f"reduce-overhead captures CUDA graphs, which need a CUDA device, but this run trains on "
                    f"{accelerator}; allowed here: default, max-autotune, max-autotune-no-cudagraphs",
                )
            if accelerator == "cuda" and cfg.tf32:
                # fp32 matmuls on TF32 tensor cores (Ampere and newer; a no-op before): what 32-true runs and the
                # fp32 parts of mixed precision want on these GPUs (torch's default is full fp32, "highest").
                torch.set_float32_matmul_precision("high")
        return self.device_plan

    def _world_size(self) -> int:
        """Ranks of this run; several ranks only inside a launched worker (torchrun / `gaudi3 train`)."""
        world = self.config.parallel.world_size
        launched = os.environ.get("WORLD_SIZE")
        if world > 1 and launched is None:
            raise UserInputError(
                f"parallel.nproc_per_node × nnodes = {world} needs a launcher: run `gaudi3 train` or "
                "`torchrun -m gaudi3_scale.train`, not GaudiTrainer directly"
            )
        if launched is not None and int(launched) != world:
            raise ConfigError(
                "parallel.nproc_per_node",
                f"the launcher started {launched} ranks but the config asks for {world}",
            )
        return world

    def build_trainer(self, state: StepState) -> pl.Trainer:
        """The Lightning Trainer for a module whose steps write `state` (the step contract): the run's strategy,
        precision and checkpoint IO, and `AfterStep`, which does everything that follows a step."""
        cfg, plan = self.config.train, self._plan_device()
        batch, parallel = self._plans()
        strategy = build_strategy(parallel, batch, accelerator=plan.accelerator,
                                  grad_clip_norm=self.config.optim.grad_clip_norm, hidden_size=self.config.model.dim,
                                  collective_timeout_s=self.config.health.collective_timeout_s)  # fmt: skip
        after = self._after_step(state, strategy, parallel.strategy, plan.peak_flops, plan.accelerator)
        trackers = build_trackers(self.config.monitor, run_name=self.config.name, hyperparameters=to_dict(self.config),
                                  out_dir=self.out_dir, metrics=after.metrics)  # monitor.loggers; None when unnamed  # fmt: skip
        kwargs: dict[str, Any] = {
            "accelerator": plan.accelerator, "devices": self.config.parallel.nproc_per_node,
            "num_nodes": self.config.parallel.nnodes, "strategy": strategy, "max_steps": cfg.max_steps,
            # Lightning counts batches: an optimizer step is `accumulation` of them for the module's own loop.
            "val_check_interval": cfg.val_every_steps * state.accumulation if cfg.val_every_steps else None,
            "check_val_every_n_epoch": None, "limit_val_batches": cfg.val_batches, "num_sanity_val_steps": 0,
            "logger": trackers.loggers if trackers is not None else False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "deterministic": cfg.deterministic,
            "default_root_dir": str(self.out_dir),
            "callbacks": [after, *([trackers] if trackers else []), *self.extra_callbacks],
            "plugins": [self._checkpointer.io],
        }  # fmt: skip
        if plan.accelerator == "hpu":
            # Lightning's own "bf16-mixed" autocasts on cuda; on Gaudi the plugin autocasts on hpu.
            # (hpu plans only hold bf16-mixed, bf16-true or 32-true: the plugin's Literal.)
            from gaudi3_scale.device.precision import GaudiMixedPrecision

            kwargs["plugins"].append(GaudiMixedPrecision(plan.precision))  # type: ignore[arg-type]
        else:
            kwargs["precision"] = plan.precision
        kwargs.update(self.trainer_kwargs)
        return pl.Trainer(**kwargs)

    def _after_step(
        self, state: StepState, strategy: Any, strategy_name: str, peak_flops: float | None, accelerator: str
    ) -> AfterStep:
        """The parts that act after each step (`train.after_step`), built from the run config."""
        cfg, ckpt_cfg, out = self.config.train, self.config.checkpoint, self.out_dir
        if ckpt_cfg.enabled and ckpt_cfg.light_every_steps and saves_sharded(strategy):
            raise ConfigError(
                "checkpoint.light_every_steps",
                f"light checkpoints are one file written by rank 0, but parallel.strategy {strategy_name} "
                "saves sharded checkpoints (not supported yet); set it to 0 and export a full checkpoint instead",
            )
        health_cfg, stragglers = self.config.health, None
        if health_cfg.stragglers:
            stragglers = StragglerDetector(
                threshold=health_cfg.straggler_threshold,
                windows=health_cfg.straggler_windows,
                warn=self._warn,
            )
        self._stragglers = stragglers
        metrics = self._metrics = RunMetrics(out / "metrics.jsonl", log_every_steps=cfg.log_every_steps,
                                             state=state, peak_flops_per_device=peak_flops,
                                             warmup_steps=cfg.resolved_throughput_warmup_steps(),
                                             stragglers=stragglers)  # fmt: skip
        # Rank 0 uploads committed checkpoints to checkpoint.remote_url; local copies stay until verified.
        checkpointer = self._checkpointer = Checkpointer(
            ckpt_cfg, out / "checkpoints", rank=_global_rank(), warn=self._warn
        ).start()
        if (mirror := checkpointer.mirror) is not None:
            metrics.sources.append(lambda: mirror.status().as_metrics())
        checkpoint = self._checkpoint = StepCheckpoint(
            checkpointer, every_steps=ckpt_cfg.every_steps, val_every_steps=cfg.val_every_steps,
            metrics=metrics, warn=self._warn, config_sha256=config_sha256(self.config),
            enabled=ckpt_cfg.enabled, data_sha256=self._data_sha256, tokens_per_step=state.tokens_per_step,
            strategy=strategy_name if isinstance(self.module, LanguageModel) else None,
            light_every_steps=ckpt_cfg.light_every_steps,
        )  # fmt: skip
        stop = self._interrupt = GracefulInterrupt(checkpoint, self.console)
        cost = self._live_cost = build_live_cost(self.config.cost, metrics, stop, checkpoint,
                                                 nodes=self.config.parallel.nnodes, max_steps=cfg.max_steps,
                                                 warn=self._warn, note=self._note, announce=self.progress)  # fmt: skip
        profiler = None
        if cfg.profile_start_step is not None:
            from gaudi3_scale.train.profile_callback import StepProfiler

            profiler = StepProfiler(out, start_step=cfg.profile_start_step, num_steps=cfg.profile_num_steps,
                                    accelerator=accelerator, note=self._note, warn=self._warn)  # fmt: skip
        progress = RichStepProgress(metrics, console=self.console) if self.progress else None
        # What our checkpoints hold beyond Lightning's entries, by owner (checkpoint.contents).
        contents = checkpointer.contents
        contents.register(CONFIG_KEY, FixedState(to_dict(self.config)), light=True)
        contents.register(RNG_KEY, RngStates())
        contents.register("step_checkpoint", checkpoint, light=True, meta=True)
        if cost is not None:
            contents.register("cost", cost, light=True, meta=True)
        health = None
        if self._guard is not None:
            contents.register(HEALTH_KEY, self._guard)
            health = self._health = StepHealth(self._guard, metrics, warn=self._warn)
        watchdog = checkpoint.watchdog = self._watchdog = self._build_watchdog()
        return AfterStep(metrics=metrics, stop=stop, checkpoint=checkpoint, cost=cost, health=health,
                         profiler=profiler, progress=progress, state=state, watchdog=watchdog)  # fmt: skip

    def fit(
        self, model: pl.LightningModule | None = None, datamodule: pl.LightningDataModule | None = None
    ) -> dict[str, Any]:
        started = time.perf_counter()
        _quiet_lightning()
        self._plan_device()  # a missing accelerator first
        check_run_inputs(self.config)  # one line before any data work (train.preflight)
        stop_with_launcher()  # a rank of a launcher that dies stops (and saves) instead of training on alone
        with run_directory_lock(self.out_dir, node_rank=self.config.parallel.node_rank):
            return self._fit(model, datamodule, started)

    def _fit(
        self, model: pl.LightningModule | None, datamodule: pl.LightningDataModule | None, started: float
    ) -> dict[str, Any]:
        """Fit; after a spike that asks for a rollback (`train.rollback`), fit again in this process from the
        checkpoint it restores, with its batches skipped, until a fit ends without one."""
        ckpt_path = resume_point(self.config, warn=self._warn)  # refused before any data work or file written
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
        # Python, numpy and torch global generators: nothing in our training draws from them (weights, data order
        # and dropout have their own seeded streams), but user code may, and checkpoints record them, so two runs
        # with the same seed must hold the same state. One stream per rank.
        pl.seed_everything(self.config.seed + _global_rank(), workers=False, verbose=False)
        if model is None:
            if datamodule is not None:
                raise ValueError("pass a datamodule together with your own model, or neither")
            model, datamodule = self._build_default(ckpt_path)
            if rollback is not None and previous_guard is not None and self._guard is not None:
                self._guard.carry_from(previous_guard, lr_scale=self.config.health.rollback_lr_scale)
        elif self.config.train.max_epochs is not None:
            raise ConfigError(
                "train.max_epochs",
                "counts passes over the run's own dataset; with your own model and datamodule set train.max_steps",
            )
        self.module, self.datamodule = model, datamodule
        out = self.out_dir
        out.mkdir(parents=True, exist_ok=True)
        if _global_rank() == 0:
            save_yaml(self.config, out / "config.yaml")
        state = self._step_state = step_state_of(model)
        trainer = self.trainer = self.build_trainer(state)
        if ckpt_path is not None:
            if isinstance(model, LanguageModel):
                check_resume_compatible(ckpt_path, to_dict(self.config))
                check_resume_data(
                    ckpt_path,
                    self._data_sha256,
                    allow_change=self.config.train.allow_data_change,
                    warn=self._warn,
                )
            if self.progress:
                self.console.print(f"resuming from {ckpt_path}")
        endpoint = self._start_metrics_endpoint(trainer)
        if rollback is not None and self._health is not None:
            if previous_health is not None:
                self._health.events[:0] = previous_health.events
            self._health.queued.append((rollback.record(), rollback.line()))
        watcher = self._start_spot_watcher()
        watchdog = self._start_watchdog()
        if self._kept_store is not None:  # a re-fit after a rollback: the ranks form their group again
            self._refits += 1
            rejoin_process_group(
                self._kept_store, attempt=self._refits, timeout_s=self.config.health.collective_timeout_s
            )
            self._kept_store = None
        try:
            trainer.fit(model, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
        finally:
            if watchdog is not None:
                watchdog.stop()
            if endpoint is not None:
                endpoint.stop()
            if watcher is not None:
                watcher.stop()
            if self._live_cost is not None and self._live_cost.spot is not None:
                self._live_cost.spot.prices.close()
            self._checkpointer.close()  # drains uploads, applies the retention that waited on them
        guard = self._guard
        if guard is not None and guard.rollback_at is not None:
            planned = self._plan_rollback(guard, guard.rollback_at)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                self._kept_store = keep_store()
            del trainer, model  # what holds the group goes with it (`_release_fit`)
            self._release_fit(datamodule)
            return planned
        records = read_metrics(out / "metrics.jsonl")
        summary = self._summary(records, time.perf_counter() - started)
        if guard is not None and guard.stop_at is not None:
            summary.update(self._spike_stop(guard.stop_at))
        if isinstance(datamodule, TokenDataModule) and datamodule.has_data:
            cache = datamodule.data.stats()  # a URL dataset's shard cache, this process's handle
            if cache:
                summary["data_cache"] = cache
        if trainer.is_global_zero:
            write_summary(out / "summary.json", summary)
            plot_loss(records, out / "loss.png", title=self._plot_title())
            if self.progress:
                print_summary(summary, self.console)
        del trainer, model  # what holds the group goes with it (`_release_fit`)
        self._release_fit(datamodule)
        return summary

    def _release_fit(self, datamodule: pl.LightningDataModule | None) -> None:
        """Lightning leaves the group up. Ours goes now, with what holds it (the caller dropped its trainer and
        module). A later fit() makes a new group."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self._leave_process_group(datamodule)

    def _plan_rollback(self, guard: StepGuard, spike_step: int) -> Rollback:
        """The rollback from the spike at `spike_step`, its batches added to the run's skips (`train.rollback`)."""
        health = self.config.health
        rollback = plan_rollback(
            self._checkpoint.manager,
            spike_step=spike_step,
            skips=guard.skips,
            global_batch_size=self._plans()[0].global_batch_size,
            skip_batches=health.rollback_skip_batches,
            lr_scale=guard.lr_scale * health.rollback_lr_scale,
        )
        self._rollback_skips.extend(rollback.skipped)
        return rollback

    def _spike_stop(self, spike_step: int) -> dict[str, Any]:
        """A spike after health.max_rollbacks rollbacks: the run stops with a restartable exit code (the summary's
        stop fields; `gaudi3 train` ends with their one line)."""
        rollbacks = self.config.health.max_rollbacks
        reason = f"a loss spike at step {spike_step}, with health.max_rollbacks ({rollbacks}) rollbacks made,"
        return {
            "interrupted": True,
            "stop_reason": reason,
            "stop_exit_code": signal_exit_code(signal.SIGTERM),
        }

    def _leave_process_group(self, datamodule: pl.LightningDataModule | None) -> None:
        """Release the fitted trainer and module, then the group, so that its gloo threads are joined before the
        process exits (`distributed.teardown`). Their parameters are shards or replicas whose collectives are
        gone; the checkpoint holds the trained state."""
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
                f"[yellow]warning:[/yellow] rank {_global_rank()}: {left} gloo worker threads are still up after the"
                " process group was destroyed: something outside the run holds a group (a model passed to fit?);"
                " release it before the process exits, or the rank may abort at exit",
                highlight=False,
                soft_wrap=True,
            )

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is rank 0 of the run (also after a multi-rank fit has released the trainer)."""
        return _global_rank() == 0

    def _start_metrics_endpoint(self, trainer: pl.Trainer) -> MetricsEndpoint | None:
        """This rank's Prometheus endpoint (`monitor.metrics_port`); a busy port is one line before training."""
        cfg = self.config.monitor
        if cfg.metrics_port is None:
            return None
        from gaudi3_scale.monitor.prometheus import start_exporter

        endpoint = start_exporter(
            cfg,
            run=self.config.name,
            out_dir=self.out_dir,
            device=trainer.strategy.root_device,
            tokens_per_step=self._metrics.tokens_per_step,
            warn=self._warn,
        )
        self._metrics.listeners.append(endpoint.observe)
        endpoint.exporter.track_checkpoint_saves(self._checkpoint.blocking_s)
        return endpoint

    def _start_spot_watcher(self) -> SpotInterruptionWatcher | None:
        """One watcher per node (local rank 0): a notice there stops every rank through GracefulInterrupt."""
        cfg = self.config.train
        if not cfg.spot_watch or int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return None
        interrupt = self._interrupt
        return SpotInterruptionWatcher(
            cfg.spot_url,
            lambda text: interrupt.request(f"spot interruption notice ({text})"),
            poll_s=cfg.spot_poll_s,
        ).start()

    def _build_watchdog(self) -> Watchdog | None:
        """This rank's hang watchdog (`health.watchdog`); AfterStep and the checkpoint enter its sections."""
        if not self.config.health.watchdog:
            return None
        from gaudi3_scale.health.watchdog import Watchdog

        return Watchdog(
            self.config.health, self.out_dir / HEALTH_DIR, rank=_global_rank(),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            warmup_steps=self.config.train.resolved_throughput_warmup_steps(),
        )  # fmt: skip

    def _start_watchdog(self) -> Watchdog | None:
        """Start watching (setup first); on CUDA the NCCL flight recorder is enabled before the process group
        exists, dumping into the same directory (a user's own TORCH_NCCL_* settings win)."""
        if self._watchdog is None:
            return None
        if self._plan_device().accelerator == "cuda":
            from gaudi3_scale.health.dumps import flight_recorder_env

            for name, value in flight_recorder_env(self._watchdog.health_dir).items():
                os.environ.setdefault(name, value)
        return self._watchdog.start()

    def _warn(self, message: str) -> None:
        if _global_rank() == 0:
            self.console.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)

    def _note(self, message: str) -> None:
        if _global_rank() == 0:
            self.console.print(message, highlight=False, soft_wrap=True)

    def _health_summary(self) -> dict[str, Any] | None:
        """summary.json's `health`: the guard's counts and events, and the stragglers named (None: all off)."""
        health = self._health.summary() if self._health is not None else None
        if self._stragglers is not None:
            health = {**(health or {}), "stragglers": [s.record() for s in self._stragglers.episodes]}
        return health

    def _plot_title(self) -> str:
        name, model = self.config.name, self.config.model.name
        return name if name == model else f"{name} ({model})"

    def _summary(self, records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
        assert self.trainer is not None
        train = [r for r in records if r.get("train_loss") is not None]
        val = [r for r in records if r.get("val_loss") is not None]
        steady = self._metrics.steady_state()
        tokens_per_s, step_time_s = steady["tokens_per_s"], steady["step_time_s"]
        if tokens_per_s is None and train:  # a resumed, already finished run: what its last window measured
            tokens_per_s, step_time_s = train[-1].get("tokens_per_s"), train[-1].get("step_time_s")
        fpt = self._step_state.flops_per_token
        plan = self.device_plan
        mfu_value = None
        if tokens_per_s and fpt and plan:
            mfu_value = mfu(tokens_per_s, fpt, plan.peak_flops, self.trainer.world_size)
        # On CPU the peak is the matmul ceiling measured at start, not a datasheet figure.
        above = mfu_above_peak(mfu_value, peak_measured=plan is None or plan.accelerator == "cpu")
        if above:
            self._warn(above)
        committed = self._checkpoint.manager.committed()
        last = self._checkpoint.last_path or (committed[-1][1] if committed else None)
        interrupt, live = self._interrupt, self._live_cost
        # Masked-language modelling also scores its predictions (train.module): a key of BERT runs' summaries only.
        bert = self.config.model.arch == "bert"
        accuracy = {"val_mlm_accuracy": val[-1].get("val_mlm_accuracy") if val else None} if bert else {}
        return {
            "name": self.config.name,
            "model": self.config.model.name,
            "steps": self.trainer.global_step,
            "train_loss": train[-1]["train_loss"] if train else None,
            "val_loss": val[-1]["val_loss"] if val else None,
            **accuracy,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu_value,
            "mfu_peak_source": plan.peak_source if plan else None,
            "mfu_above_peak": above is not None,
            "step_time_s": step_time_s,
            # tokens/s, MFU and step time are over the measured steps, after this process's warm-up steps
            # (train.throughput_warmup_steps), whose time (compilation included) is reported on its own.
            "measured_steps": steady["measured_steps"],
            "warmup_steps": steady["warmup_steps"],
            "warmup_s": steady["warmup_s"],
            "throughput_includes_warmup": steady["includes_warmup"],
            "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0 for r in train), default=None),
            "wall_s": wall_s,
            "interrupted": bool(self.trainer.interrupted or self._checkpoint.save_requested),
            # A stop the run asked for itself (budget, spot price) has an exit code of its own and no signal.
            "stop_signal": interrupt.signal_name if interrupt.exit_code is None else None,
            "stop_reason": interrupt.reason if interrupt.signal_name else None,
            "stop_exit_code": interrupt.exit_code,
            "signal_to_checkpoint_s": interrupt.signal_to_checkpoint_s,
            "checkpoint_blocking_s": self._checkpoint.blocking_s,
            "checkpoint": str(last) if last else None,
            "device": plan.device_name if plan else None,
            "precision": plan.precision_name if plan else None,
            "cost_usd": live.meter.cost_usd if live is not None else None,
            "cost_budget_usd": live.meter.budget_usd if live is not None else None,
            "health": self._health_summary(),
        }
