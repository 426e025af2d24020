"""LightningModule for registry language models.

Optimization is manual: Lightning's automatic path wraps every step in a closure and several hook layers, which on
a small model costs more than the 3 % framework overhead we allow. Doing accumulation, clipping and the LR schedule
here keeps the math identical to a plain PyTorch loop and still lets Lightning own devices, precision,
distribution and checkpoint I/O.
"""

from __future__ import annotations

import inspect
import io
import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gaudi3_scale.checkpoint.contents import CONFIG_KEY, RNG_KEY
from gaudi3_scale.device.hpu import apply_hpu_graphs, mark_step
from gaudi3_scale.distributed.parallelize import apply_activation_checkpointing, apply_fsdp
from gaudi3_scale.models import ModelConfig, build_model, flops_per_token
from gaudi3_scale.train.config import CUDA_GRAPH_COMPILE_MODES, OptimConfig
from gaudi3_scale.train.optim import build_optimizer, lr_at_step

__all__ = [
    "CONFIG_KEY",
    "RNG_KEY",
    "LanguageModel",
    "capture_rng_state",
    "next_token_loss",
    "restore_rng_state",
]


def capture_rng_state() -> dict[str, Any]:
    # Plain containers and tensors only, so checkpoints load with torch.load(weights_only=True).
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(np.array(keys)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def next_token_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token logits (over the padded vocabulary: padding rows learn to lose)."""
    logits = model(tokens)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _bind_loss(model: nn.Module) -> Any:
    """`(tokens, targets) -> loss` for `model`: a plain function, which torch.compile traces as one region."""

    def loss_fn(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(model, tokens, targets)

    return loss_fn


# Plain attributes set on every step: `_current_fx_name` by Lightning, twice around each of its 16 hook calls a step
# (Lightning 2.6, manual optimization), `_micro_step` by `training_step`.
_PLAIN_ATTRS = frozenset({"_current_fx_name", "_micro_step"})
_PLAIN_TYPES = (str, int, type(None))


class LanguageModel(pl.LightningModule):
    """Next-token prediction for a `ModelConfig`; `vocab_size` must already be resolved."""

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
        accumulation: int = 1,
        seed: int = 0,
        compile: bool = False,
        compile_mode: str = "default",
        float8: bool = False,
        strategy: str = "single",
        activation_checkpointing: bool = False,
        hpu_graphs: bool = False,
    ) -> None:
        super().__init__()
        if model_cfg.vocab_size is None:
            raise ValueError(
                "model_cfg.vocab_size must be resolved from the dataset before building the module"
            )
        self.model_cfg = model_cfg
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps
        self.accumulation = accumulation
        self.seed = seed
        self.compile_model = compile
        self.compile_mode = compile_mode
        self.float8 = float8
        self.strategy_name = strategy
        self.activation_checkpointing = activation_checkpointing
        self.hpu_graphs = hpu_graphs
        self.automatic_optimization = False
        self.model: nn.Module | None = None
        self._loss_fn: Any = None  # (tokens, targets) -> loss; compiled as one region with train.compile
        self._cuda_graphs = False
        self._micro_step = 0
        self._pending_loss = torch.zeros(())
        # Read by the metrics callback; a detached tensor, so no host sync on steps that are not logged.
        self.last_loss: torch.Tensor | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self._clip_params: list[nn.Parameter] | None = None  # built at the first step of a fit
        self.tokens_per_step = 0  # set by the trainer: global batch × context length
        self.flops_per_token = flops_per_token(model_cfg, model_cfg.context_length)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # Same weights on every rank and in every run with this seed, whatever consumed the global RNG before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = build_model(self.model_cfg)
        # torchtitan's order: float8 linears → activation checkpointing → compile → FSDP.
        if self.float8:
            from gaudi3_scale.device.float8 import apply_float8

            apply_float8(model)
        if self.activation_checkpointing:
            apply_activation_checkpointing(model)
        loss_fn = _bind_loss(model)
        if self.compile_model:
            # The loss goes inside the compiled region: Inductor then fuses the head's log-softmax with the logits'
            # fp32 upcast instead of materialising fp32 logits for the whole batch. On an H100 (GPT-2 124M,
            # micro-batch 32, 2026-11-25) compiling the model alone gave 80.5 ms/step and a 29.4 GB peak; with the
            # loss inside, 68.1 ms and 15.1 GB, as fast as nanoGPT's train.py.
            mode = None if self.compile_mode == "default" else self.compile_mode
            loss_fn = torch.compile(loss_fn, mode=mode)
            self._cuda_graphs = self.compile_mode in CUDA_GRAPH_COMPILE_MODES
        if self.hpu_graphs:
            apply_hpu_graphs(model)
        if self.strategy_name in ("fsdp", "fsdp_grad_op"):
            mesh = self.device_mesh  # set by ModelParallelStrategy before configure_model
            assert mesh is not None, "FSDP strategies run under ModelParallelStrategy"
            # bf16-mixed under FSDP is FSDP's own policy: bf16 parameters for compute, fp32 gradient reduction.
            bf16 = self._trainer is not None and str(self.trainer.precision).startswith("bf16-mixed")
            apply_fsdp(
                model,
                mesh["data_parallel"],
                reshard_after_forward=self.strategy_name == "fsdp",
                param_dtype=torch.bfloat16 if bf16 else None,
            )
        self.model = model
        # Not registered as a submodule: a compiled wrapper would duplicate every key in the state dict.
        object.__setattr__(self, "_loss_fn", loss_fn)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens`; with `targets`, the mean next-token loss (through the compiled region, if any)."""
        if targets is not None:
            return self._loss_fn(tokens, targets)
        assert self.model is not None, "configure_model() builds the model"
        return self.model(tokens)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        # Under DeepSpeed the forward pass goes through the engine (its hooks, bf16 casts); it calls forward().
        engine = self._deepspeed_engine() if self.training else None
        if self._cuda_graphs and self.device.type == "cuda":
            # A new iteration for CUDA graph trees: the previous replay's outputs may be overwritten from here on.
            torch.compiler.cudagraph_mark_step_begin()
            loss = self._loss_fn(x, y)
            return loss.clone()  # kept across micro-steps (accumulation, logging): out of the graph's pool
        return engine(x, y) if engine is not None else self._loss_fn(x, y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # DDP all-reduces gradients only on the last micro-batch of an optimizer step (what `no_sync` does). Set
        # here because Lightning runs training_step inside DDP's forward, which reads the flag first.
        ddp = self.trainer.strategy.model
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            ddp.require_backward_grad_sync = self._micro_step + 1 == self.accumulation

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        assert not isinstance(opt, list)
        if self.model_cfg.dropout > 0:
            # Dropout masks are a function of (seed, step, micro-step, rank) only, so a resumed run draws the
            # same masks as an uninterrupted one no matter what else consumed the global RNG in between.
            step = self.trainer.global_step * self.accumulation + self._micro_step
            torch.manual_seed((self.seed * 1_000_003 + step) * 4099 + self.global_rank)
        engine = self._deepspeed_engine()
        if engine is not None:
            # DeepSpeed divides the loss by the accumulation itself and reduces gradients at the boundary we name.
            engine.set_gradient_accumulation_boundary(self._micro_step + 1 == self.accumulation)
        loss = self._loss(batch)
        scaled = loss / self.accumulation if self.accumulation > 1 and engine is None else loss
        self.manual_backward(scaled)
        if self.device.type == "hpu":
            mark_step()
        self._micro_step += 1
        if self._micro_step < self.accumulation:
            self._pending_loss = (
                (self._pending_loss + loss.detach()) if self._micro_step > 1 else loss.detach()
            )
            return
        if self.accumulation > 1:
            loss = (self._pending_loss + loss.detach()) / self.accumulation
        self._micro_step = 0
        clip = self.optim_cfg.grad_clip_norm
        if clip > 0 and engine is None:  # DeepSpeed clips inside its step (gradients live in its partitions)
            if self.trainer.precision == "16-mixed":
                self.clip_gradients(opt.optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")
            else:
                if self._clip_params is None:
                    # `self.parameters()` walks the module tree on every call: ~660k instructions a step (~70 µs)
                    # on the default CPU model (callgrind), for a list that does not change during a fit.
                    self._clip_params = list(self.parameters())
                self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self._clip_params, clip)
        lr = lr_at_step(self.trainer.global_step, self.optim_cfg, self.max_steps)
        for group in opt.optimizer.param_groups:
            group["lr"] = lr
        opt.step()
        if self.device.type == "hpu":
            mark_step()
        opt.zero_grad(set_to_none=True)
        if engine is not None and clip > 0:
            self.last_grad_norm = torch.tensor(float(engine.get_global_grad_norm()))
        self.last_loss = loss.detach()

    def on_train_start(self) -> None:
        self._clip_params = None  # the parameters may have been replaced since the last fit: list them again

    def _deepspeed_engine(self) -> Any:
        """The DeepSpeed engine when a ZeRO strategy wraps this module, else None."""
        if not self.strategy_name.startswith("deepspeed"):
            return None
        return self.trainer.strategy.model

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), on_epoch=True, sync_dist=True, batch_size=batch[0].size(0))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None, "configure_model() runs before configure_optimizers()"
        # torch's fused AdamW takes FSDP2's DTensor shards too (checked on torch 2.13, CPU): no temporaries the
        # size of the whole shard, unlike foreach, which matters for the ZeRO memory savings.
        return build_optimizer(self.model, self.optim_cfg, device_type=self.device.type)

    def current_lr(self) -> float:
        return lr_at_step(max(0, self.trainer.global_step - 1), self.optim_cfg, self.max_steps)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Every rank's generators (each rank has its own stream), gathered in rank order.
        states: list[Any] = [capture_rng_state()]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Gathered as torch.save bytes: all_gather_object cannot unpickle tensors on every torch version.
            buffer = io.BytesIO()
            torch.save(states[0], buffer)
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, buffer.getvalue())
            states = [torch.load(io.BytesIO(b), weights_only=True) for b in gathered]
        checkpoint[RNG_KEY] = {"per_rank": states}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.configure_model()
        states = checkpoint.get(RNG_KEY, {}).get("per_rank", [])
        # On a new world size a rank the checkpoint has no state for keeps its fresh seed + rank stream.
        if self.global_rank < len(states):
            restore_rng_state(states[self.global_rank])


# Lightning reads training_step's signature on every step (`_TrainingEpochLoop._build_kwargs`, via
# inspect.getfullargspec: ~11 µs hot, ~60 µs in the loop on the default CPU run). A precomputed `__signature__` is
# what inspect returns first, so the same answer costs ~4 µs.
LanguageModel.training_step.__signature__ = inspect.signature(LanguageModel.training_step)  # type: ignore[attr-defined]
