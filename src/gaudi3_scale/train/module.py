"""LightningModule for registry language models: next-token prediction, or masked-language modelling for arch bert.

Optimization is manual: Lightning's automatic path wraps every step in a closure and several hook layers, which on
a small model costs more than the 3 % framework overhead we allow. Doing accumulation, clipping and the LR schedule
here keeps the math identical to a plain PyTorch loop and still lets Lightning own devices, precision,
distribution and checkpoint I/O.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from gaudi3_scale.checkpoint.contents import CONFIG_KEY
from gaudi3_scale.data.mlm import IGNORE_INDEX
from gaudi3_scale.device.hpu import mark_step
from gaudi3_scale.distributed.grad_sync import GradientSync, gradient_sync
from gaudi3_scale.distributed.parallelize import build_parallelized
from gaudi3_scale.distributed.pipeline import Pipeline
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.health.guard import StepGuard
from gaudi3_scale.health.inject import faults_from_env, inject_delay, inject_into_loss
from gaudi3_scale.health.rerun import batch_locations, compare_reruns
from gaudi3_scale.models import ModelConfig, flops_per_token
from gaudi3_scale.models.common.moe import MoEFeedForward, moe_layers, router_losses
from gaudi3_scale.train.optim import build_optimizer, lr_at_step
from gaudi3_scale.train.optim_config import OptimConfig
from gaudi3_scale.train.step import SteppedModule, StepState

__all__ = ["CONFIG_KEY", "LanguageModel", "masked_lm_loss", "next_token_loss"]


def next_token_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token logits (vocabulary padding has no probability: `models.vocab`)."""
    logits = model(tokens)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def masked_lm_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the masked positions only: `labels` is IGNORE_INDEX everywhere else (data.mlm)."""
    return _masked_cross_entropy(model(inputs), labels)


def _masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=IGNORE_INDEX)


def masked_lm_metrics(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, accuracy) over the masked positions: accuracy is how often the top logit is the original token."""
    loss = _masked_cross_entropy(logits, labels)
    selected = labels != IGNORE_INDEX
    accuracy = (logits.argmax(-1)[selected] == labels[selected]).float().mean()
    return loss, accuracy


# Plain attributes set on every step: `_current_fx_name` by Lightning, twice around each of its 16 hook calls a step
# (Lightning 2.6, manual optimization).
_PLAIN_ATTRS = frozenset({"_current_fx_name"})
_PLAIN_TYPES = (str, int, type(None))


class LanguageModel(SteppedModule, pl.LightningModule):
    """Next-token prediction for a `ModelConfig`; `vocab_size` must already be resolved.

    One optimizer step is `accumulation` calls of `training_step` (the `BatchPlan`); what a step produces is
    written to `step_state` (`train.step.StepState`), which the callbacks read. How the model is spread over
    devices is `parallelize(model, plan)` in `configure_model`; what a data-parallel wrapper does at gradient
    boundaries is `distributed.grad_sync`, so the step itself has no distribution logic.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        # nn.Module.__setattr__ checks every value against Parameter, Module and Buffer (Python-level metaclass
        # checks): ~1.3 µs a call, 34 such calls a step. An attribute already in __dict__ is none of those, and a
        # str, int or None value cannot become one, so nn.Module would end in object.__setattr__, which for these
        # names (no descriptor on the class) is a store into __dict__.
        attrs = self.__dict__
        if name in _PLAIN_ATTRS and name in attrs and type(value) in _PLAIN_TYPES:
            attrs[name] = value
        else:
            super().__setattr__(name, value)

    def __init__(
        self,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        *,
        max_steps: int,
        batch: BatchPlan | None = None,
        parallel: ParallelPlan | None = None,
        seed: int = 0,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        if model_cfg.vocab_size is None:
            raise ValueError(
                "model_cfg.vocab_size must be resolved from the dataset before building the module"
            )
        self.model_cfg = model_cfg
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps
        self.batch_plan = batch
        self.parallel_plan = parallel or ParallelPlan()
        self.seed = seed
        # Pretrained weights to start from (`model.init_from`); None for a resumed run, whose checkpoint wins.
        self.init_from = init_from
        self.automatic_optimization = False
        self.model: nn.Module | None = None
        self._loss_fn: Any = None  # (tokens, targets) -> loss; compiled as one region with train.compile
        self._step_context: Any = contextlib.nullcontext  # forward + backward run inside it (loss parallel)
        fpt = flops_per_token(model_cfg, model_cfg.context_length)
        self.step_state = (
            StepState.for_plan(batch, flops_per_token=fpt) if batch else StepState(flops_per_token=fpt)
        )
        self.step_state.compute_s = 0.0  # measured in training_step (health.stragglers)
        self._sync = GradientSync()  # the strategy's, from on_train_start
        self._pending_loss = torch.zeros(())
        self._clip_params: list[nn.Parameter] | None = None  # built at the first step of a fit
        self._moe_layers: list[MoEFeedForward] = []  # their router losses join the training objective
        # Whether a step's update is applied (health.guard), set by the trainer; None: always.
        self.guard: StepGuard | None = None
        self._faults = faults_from_env()  # test-only fault injection (health.inject); () in a real run
        # health.rerun_check: this step's (micro-batch, loss) pairs, kept for a re-run; None when it is off.
        self._window: list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]] | None = None
        # Pipeline parallel: the schedule over this rank's stages, and the micro-batches of the step so far.
        self._pipeline: Pipeline | None = None
        self._stashed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # Same weights on every rank, in every run with this seed and whatever the layout: the init depends only on
        # the seed and each parameter's name (models.common.init). A sharding plan builds the model on meta and
        # each rank allocates and initialises only its shards (parallelize), never the whole model.
        plan = self.parallel_plan
        # With `init_from` the model is built on meta on every plan and each rank reads only its blocks of the
        # pretrained weights (models.pretrained_reader); rows the checkpoint lacks (vocabulary padding) get the seeded init.
        init_weights = None
        if self.init_from is not None:
            from gaudi3_scale.models.pretrained import open_pretrained
            from gaudi3_scale.models.pretrained_reader import load_pretrained

            checkpoint = open_pretrained(self.init_from)

            def init_weights(model: nn.Module, gathered: Any = None) -> None:
                load_pretrained(model, checkpoint, seed=self.seed, gathered=gathered)

        # A sharding strategy (ModelParallelStrategy) sets the device mesh before configure_model.
        applied = build_parallelized(
            self.model_cfg,
            plan,
            seed=self.seed,
            loss=masked_lm_loss if self.model_cfg.arch == "bert" else next_token_loss,
            mesh=self.device_mesh if plan.shards_parameters else None,  # also the tensor-parallel one
            device=self.trainer.strategy.root_device if plan.shards_parameters else None,
            init_weights=init_weights,
            micro_batches=self.step_state.accumulation,
        )
        self._pipeline = applied.pipeline
        self.model = applied.model
        self._moe_layers = moe_layers(applied.model)
        # Not registered as a submodule: a compiled wrapper would duplicate every key in the state dict.
        object.__setattr__(self, "_loss_fn", applied.loss_fn)
        self._step_context = applied.step_context

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens`; with `targets`, the mean next-token loss (through the compiled region, if any)."""
        if targets is not None:
            return self._loss_fn(tokens, targets)
        assert self.model is not None, "configure_model() builds the model"
        return self.model(tokens)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.parallel_plan.cuda_graphs and self.device.type == "cuda":
            # A new iteration for CUDA graph trees: the previous replay's outputs may be overwritten from here on.
            torch.compiler.cudagraph_mark_step_begin()
            loss = self._loss_fn(x, y)
            return loss.clone()  # kept across micro-steps (accumulation, logging): out of the graph's pool
        if self.training:
            return self._sync.forward(self._loss_fn, x, y)  # DeepSpeed runs the forward through its engine
        return self._loss_fn(x, y)

    def _clip(self, clip: float, scaler: Any) -> torch.Tensor | None:
        """Clip the gradients' global L2 norm (all stages' under a pipeline) at `clip`; their norm before clipping.

        16-mixed (`scaler`, Lightning's GradScaler): the gradients here are still multiplied by the loss scale S,
        which Lightning divides out inside `opt.step()`, after this (its own `clip_gradients` in manual optimization
        clips them scaled, Lightning issue #18089, and refuses a fused AdamW outright). Clipping the scaled gradients
        at clip × S is clipping the true ones at clip, and their norm ÷ S is the true norm. A step whose scaled
        gradients overflowed is the scaler's to skip (and to lower S): its norm is None, so the health guard, which
        would drop the step and with it the scaler's update, judges it by its loss alone."""
        pipeline, params = self._pipeline, self._clip_params
        assert params is not None

        def clipped(max_norm: float) -> torch.Tensor:
            if pipeline is None:
                return torch.nn.utils.clip_grad_norm_(params, max_norm)
            return pipeline.clip_grad_norm(params, max_norm)

        if scaler is None:
            return clipped(clip)
        scale = scaler.get_scale()
        norm = clipped(clip * scale)
        return norm / scale if bool(torch.isfinite(norm)) else None

    def on_train_start(self) -> None:
        self._window = [] if self.guard is not None and self.guard.cfg.rerun_check else None
        self._stashed = []  # micro-batches of a step an earlier fit did not finish
        self._clip_params = None  # the parameters may have been replaced since the last fit: list them again
        self._sync = gradient_sync(self.trainer.strategy.model)

    def on_train_end(self) -> None:
        self._drop_sync()

    def teardown(self, stage: str) -> None:
        self._drop_sync()  # also after a failed fit, where on_train_end does not run

    def _drop_sync(self) -> None:
        # The sync holds the strategy's wrapper (DDP and its reducer, or DeepSpeed's engine), which holds the process
        # group: kept past the fit, gloo's threads outlive destroy_process_group and abort the process at exit.
        self._sync = GradientSync()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Before training_step: Lightning runs it inside DDP's forward, which reads the sync flag first.
        state = self.step_state
        self._sync.begin_micro_step(state.micro_step + 1 == state.accumulation)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        # This rank's own compute (health.stragglers): from here to its loss, the injected delay included. The
        # forward has no collective under DDP (Lightning calls this inside DDP's forward, after its buffer sync),
        # while the backward's all-reduce waits for the slowest rank, so only the forward tells the ranks apart.
        started = time.perf_counter()
        opt = self.optimizers()
        assert not isinstance(opt, list)
        state, sync = self.step_state, self._sync
        pipeline = self._pipeline
        step_loss = self._accumulate(batch, started) if pipeline is None else self._pipelined(batch)
        if step_loss is None:  # not the step's last micro-batch
            return
        loss = step_loss
        state.micro_step = 0
        window = self._window
        clip = self.optim_cfg.grad_clip_norm
        if clip > 0 and not sync.clips:
            if self._clip_params is None:
                # `self.parameters()` walks the module tree on every call: ~660k instructions a step (~70 µs)
                # on the default CPU model (callgrind), for a list that does not change during a fit.
                self._clip_params = list(self.parameters())
            state.grad_norm = self._clip(clip, getattr(self.trainer.precision_plugin, "scaler", None))
        guard = self.guard
        if guard is not None and not sync.clips:  # DeepSpeed clips and steps inside its engine
            state.update_dropped = not guard.check(self.trainer.global_step, loss, state.grad_norm)
            if guard.pending and window is not None:
                self._rerun_step(guard, window)
            if state.update_dropped:  # no update, no scheduler tick (the lr follows global_step, unchanged)
                opt.zero_grad(set_to_none=True)
                state.loss = loss.detach()
                state.compute_s = 0.0  # a dropped step is not booked (RunMetrics does not see it)
                return
        lr = lr_at_step(self.trainer.global_step, self.optim_cfg, self.max_steps)
        if guard is not None and guard.lr_scale != 1.0:  # after a rollback with health.rollback_lr_scale < 1
            lr *= guard.lr_scale
        for group in opt.optimizer.param_groups:
            group["lr"] = lr
        opt.step()
        if self.device.type == "hpu":
            mark_step()
        opt.zero_grad(set_to_none=True)
        if sync.clips and clip > 0:
            state.grad_norm = sync.grad_norm()
        state.lr = lr
        state.loss = loss.detach()

    def _accumulate(self, batch: tuple[torch.Tensor, torch.Tensor], started: float) -> torch.Tensor | None:
        """One micro-batch's forward and backward; at the step's last micro-batch, the step's mean loss."""
        state = self.step_state
        accumulation = state.accumulation
        loss = self._forward_backward(batch, state.micro_step, started=started)
        window = self._window
        if window is not None:  # health.rerun_check: the step's micro-batches and losses, for a re-run
            if state.micro_step == 0:
                window.clear()
            window.append((batch, loss.detach()))
        state.micro_step += 1
        if state.micro_step < accumulation:
            self._pending_loss = (
                (self._pending_loss + loss.detach()) if state.micro_step > 1 else loss.detach()
            )
            return None
        if accumulation > 1:
            loss = (self._pending_loss + loss.detach()) / accumulation
        return loss

    def _pipelined(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        """Pipeline parallel: keep the micro-batch; at the step's last, run them all through the schedule (which
        takes them concatenated and splits them again) and return their mean loss, the same on every stage."""
        state = self.step_state
        self._stashed.append(batch)
        state.micro_step += 1
        if state.micro_step < state.accumulation:
            return None
        batches, self._stashed = self._stashed, []
        step_batch = (torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
        loss = self._pipeline_step(step_batch)
        if self._window is not None:  # health.rerun_check: a pipeline re-runs its whole step
            self._window[:] = [(step_batch, loss.detach())]
        return loss

    def _pipeline_step(
        self,
        batch: tuple[torch.Tensor, torch.Tensor],
        *,
        rerun: bool = False,
        data_step: int | None = None,
    ) -> torch.Tensor:
        """One step's micro-batches through the pipeline's schedule; their mean loss. `rerun`: the health.rerun of
        the step, which draws the same dropout masks, meets no injected delay and is not booked as compute."""
        state, pipeline = self.step_state, self._pipeline
        assert pipeline is not None
        if self.model_cfg.dropout > 0:
            # As `_forward_backward` seeds each micro-step: the step's masks are a function of (seed, step, rank)
            # only, so a resumed run and a re-run draw the same ones.
            step = self.trainer.global_step * state.accumulation
            torch.manual_seed((self.seed * 1_000_003 + step) * 4099 + self.global_rank)
        faults = self._faults
        # under a pipeline a loss fault acts on the last stage, on each micro-batch's loss of its step, and a delay
        # before each forward of a stage of the rank
        if faults:
            step_of_data = data_step if data_step is not None else self._data_step()
            rank = self.global_rank
            pipeline.loss_hook = lambda loss: inject_into_loss(
                faults, loss, step=step_of_data, rank=rank, rerun=rerun
            )
            if not rerun:
                pipeline.before_forward = lambda: inject_delay(faults, step=step_of_data, rank=rank)
        try:
            with self._step_context():
                loss = pipeline.train_step(*batch)
        finally:
            pipeline.loss_hook = pipeline.before_forward = None
        if not rerun:
            # this rank's own compute (health.stragglers): its stages' forwards, as a one-process step books the
            # forwards of its micro-batches; the step's time would hold the waits for the other stages
            state.compute_s = (state.compute_s or 0.0) + pipeline.forward_s
        return loss

    def _data_step(self) -> int:
        """The data step this optimizer step reads (the skipped batches of health.skip_batches and of dropped
        updates counted)."""
        guard = self.guard
        return guard.skips.next_data_step(self.trainer.global_step) if guard else self.trainer.global_step

    def _forward_backward(
        self,
        batch: tuple[torch.Tensor, torch.Tensor],
        micro_step: int,
        *,
        started: float | None = None,
        data_step: int | None = None,
    ) -> torch.Tensor:
        """One micro-batch's forward and backward pass; its loss. `started` = None: a re-run (health.rerun) of a
        micro-step already run, which draws the same dropout masks and is not booked as compute."""
        state = self.step_state
        accumulation = state.accumulation
        if self.model_cfg.dropout > 0:
            # Dropout masks are a function of (seed, step, micro-step, rank) only, so a resumed run draws the
            # same masks as an uninterrupted one no matter what else consumed the global RNG in between.
            step = self.trainer.global_step * accumulation + micro_step
            torch.manual_seed((self.seed * 1_000_003 + step) * 4099 + self.global_rank)
        faults = self._faults
        if faults:
            if data_step is None:
                data_step = self._data_step()
            if started is not None:
                inject_delay(faults, step=data_step, rank=self.global_rank)
        with self._step_context():
            loss = self._loss(batch)
            if started is not None:
                state.compute_s = (state.compute_s or 0.0) + time.perf_counter() - started
            if faults and micro_step + 1 == accumulation and data_step is not None:
                loss = inject_into_loss(
                    faults, loss, step=data_step, rank=self.global_rank, rerun=started is None
                )
            objective = self._with_router_losses(loss) if self._moe_layers else loss
            scaled = (
                objective / accumulation if accumulation > 1 and not self._sync.divides_loss else objective
            )
            self.manual_backward(scaled)
        if self.device.type == "hpu":
            mark_step()
        return loss

    def _rerun_step(
        self, guard: StepGuard, window: list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]
    ) -> None:
        """health.rerun_check: the step the guard just flagged, once more from the same state (the parameters
        are not updated yet; the gradients are recomputed), compared bit for bit (`health.rerun`). The gradients
        left are the re-run's: the same as the first run's when it reproduces."""
        state, sync = self.step_state, self._sync
        first_losses = [loss.float().item() for _, loss in window]
        first_norm = None if state.grad_norm is None else _plain_float(state.grad_norm)
        dropped = guard.pending[
            -1
        ].data_step  # the batch a skip dropped (already counted by the stream's skips)
        data_step = dropped if dropped is not None else guard.skips.next_data_step(self.trainer.global_step)
        opt = self.optimizers()
        assert not isinstance(opt, list)
        opt.zero_grad(set_to_none=True)
        rerun_losses = []
        pipeline = self._pipeline
        if pipeline is not None:  # the window is the step (its loss is the pipeline's, the same on its ranks)
            ((batch, _),) = window
            rerun_losses.append(self._pipeline_step(batch, rerun=True, data_step=data_step).float().item())
        else:
            for micro_step, (batch, _) in enumerate(window):
                sync.begin_micro_step(micro_step + 1 == len(window))
                loss = self._forward_backward(batch, micro_step, data_step=data_step)
                rerun_losses.append(loss.detach().float().item())
        rerun_norm = None
        if first_norm is not None and self._clip_params is not None:
            clip = self.optim_cfg.grad_clip_norm
            norm = (
                torch.nn.utils.clip_grad_norm_(self._clip_params, clip)
                if pipeline is None
                else pipeline.clip_grad_norm(self._clip_params, clip)  # the norm of all stages
            )
            rerun_norm = _plain_float(norm)
        sampler = getattr(getattr(self.trainer, "datamodule", None), "sampler", None)
        verdict = compare_reruns(
            first_losses, rerun_losses, first_norm, rerun_norm, batch=batch_locations(sampler, data_step)
        )
        guard.add_rerun(verdict.record())

    def _with_router_losses(self, loss: torch.Tensor) -> torch.Tensor:
        """The cross-entropy plus the MoE router losses of the forward that produced it (Switch load balancing,
        ST-MoE z-loss; `models.common.moe`), which are logged apart: `train_loss` stays the cross-entropy, as
        `val/loss` (evaluation adds no router loss)."""
        router = router_losses(self._moe_layers)
        cfg = self.model_cfg
        self.step_state.extra["train/moe_aux_loss"] = router.aux.detach()
        self.step_state.extra["train/moe_z_loss"] = router.z.detach()
        return loss + cfg.moe_aux_loss_coef * router.aux + cfg.moe_z_loss_coef * router.z

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        size = batch[0].size(0)
        if self.model_cfg.arch == "bert":  # batch = (masked inputs, labels): loss and accuracy, one forward
            assert self.model is not None
            with self._step_context():
                loss, accuracy = masked_lm_metrics(self.model(batch[0]), batch[1])
            self.log("val/mlm_accuracy", accuracy, on_epoch=True, sync_dist=True, batch_size=size)
        else:
            with self._step_context():
                loss = self._loss(batch)
        self.log("val/loss", loss, on_epoch=True, sync_dist=True, batch_size=size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None, "configure_model() runs before configure_optimizers()"
        # torch's fused AdamW takes FSDP2's DTensor shards too (checked on torch 2.13, CPU): no temporaries the
        # size of the whole shard, unlike foreach, which matters for the ZeRO memory savings.
        return build_optimizer(self.model, self.optim_cfg, device_type=self.device.type)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.configure_model()  # the model exists before Lightning loads its weights into it


def _plain_float(value: torch.Tensor) -> float:
    """A tensor's value as a float, when it may be a DTensor (FSDP's gradient norm is one, already reduced)."""
    full = getattr(value, "full_tensor", None)
    return float((full() if full is not None else value).detach().float().item())


# Lightning reads training_step's signature on every step (`_TrainingEpochLoop._build_kwargs`, via
# inspect.getfullargspec: ~11 µs hot, ~60 µs in the loop on the default CPU run). A precomputed `__signature__` is
# what inspect returns first, so the same answer costs ~4 µs.
LanguageModel.training_step.__signature__ = inspect.signature(LanguageModel.training_step)  # type: ignore[attr-defined]
