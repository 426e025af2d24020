"""The step contract (train.step), the batch and parallel plans (distributed.plan), `parallelize` and the gradient
sync behind the strategy: real modules, real optimizer steps, a real one-rank gloo group for DDP."""

from __future__ import annotations

import socket
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.distributed.grad_sync import DDPSync, GradientSync, gradient_sync
from gaudi3_scale.distributed.parallelize import parallelize
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.distributed.teardown import leave_process_group
from gaudi3_scale.models import build_model, flops_per_token, get_model_config
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.train.module import LanguageModel, next_token_loss
from gaudi3_scale.train.optim_config import OptimConfig
from gaudi3_scale.train.step import at_step_boundary, step_state_of

TINY = get_model_config("shakespeare-char").resolve_vocab(65)
TINY = type(TINY)(**{**TINY.__dict__, "num_layers": 2, "dim": 32, "num_heads": 2, "context_length": 16})


def test_batch_plan_splits_the_global_batch_once() -> None:
    plan = BatchPlan.build(global_batch_size=64, micro_batch_size=4, data_parallel_size=2, context_length=128)
    assert (plan.accumulation, plan.per_rank_batch_size, plan.tokens_per_step) == (8, 32, 64 * 128)
    whole = BatchPlan.build(global_batch_size=64, micro_batch_size=None, data_parallel_size=4)
    assert (whole.micro_batch_size, whole.accumulation, whole.tokens_per_step) == (16, 1, 0)
    with pytest.raises(
        ConfigError,
        match=r"^train.global_batch_size: 48 is not divisible by .* \(5\) × ranks \(2\) = 10; allowed: a multiple "
        r"of 10$",
    ):
        BatchPlan.build(global_batch_size=48, micro_batch_size=5, data_parallel_size=2)


def test_run_config_resolves_both_plans() -> None:
    cfg = build_run_config(
        None, parse_overrides(["--train.global_batch_size=32", "--train.micro_batch_size=4"])
    )
    assert cfg.batch_plan(2) == BatchPlan(
        global_batch_size=32,
        micro_batch_size=4,
        accumulation=4,
        data_parallel_size=2,
        context_length=cfg.model.context_length,
    )
    assert cfg.parallel_plan(1).strategy == "single" and cfg.parallel_plan(2).strategy == "ddp"
    assert not cfg.parallel_plan(2, bf16_mixed=True).bf16_params  # DDP: Lightning's autocast, no FSDP policy
    fsdp = build_run_config(None, parse_overrides(["--parallel.strategy=fsdp", "--train.compile=true"]))
    plan = fsdp.parallel_plan(2, bf16_mixed=True)
    assert plan.shards_parameters and plan.reshard_after_forward and plan.bf16_params and plan.compile
    assert not fsdp.parallel_plan(2).bf16_params
    grad_op = build_run_config(None, parse_overrides(["--parallel.strategy=fsdp_grad_op"])).parallel_plan(2)
    assert grad_op.shards_parameters and not grad_op.reshard_after_forward
    zero = build_run_config(None, parse_overrides(["--parallel.strategy=deepspeed_zero2"])).parallel_plan(2)
    assert zero.uses_deepspeed and not zero.shards_parameters
    with pytest.raises(ValueError, match="resolved"):
        ParallelPlan(strategy="auto")


def test_parallelize_applies_the_plan_and_keeps_parameter_names() -> None:
    torch.manual_seed(0)
    plain = build_model(TINY)
    names = [name for name, _ in plain.named_parameters()]
    x = torch.randint(0, 65, (2, 16))
    y = torch.randint(0, 65, (2, 16))
    reference = next_token_loss(plain, x, y)
    applied = parallelize(plain, ParallelPlan(activation_checkpointing=True), loss=next_token_loss)
    assert applied.model is plain and [name for name, _ in plain.named_parameters()] == names
    assert all(getattr(block.forward, "activation_checkpointed", False) for block in plain.layers)
    assert torch.equal(applied.loss_fn(x, y), reference)  # recomputation changes memory, not values
    with pytest.raises(ValueError, match="fsdp shards over a device mesh"):
        parallelize(build_model(TINY), ParallelPlan(strategy="fsdp", world_size=2), loss=next_token_loss)


def _tiny_module(accumulation: int) -> LanguageModel:
    batch = BatchPlan.build(
        global_batch_size=2 * accumulation, micro_batch_size=2, data_parallel_size=1, context_length=16
    )
    return LanguageModel(TINY, OptimConfig(warmup_steps=0), max_steps=4, batch=batch, seed=3)


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, bool, float | None, float | None]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        state = step_state_of(pl_module)
        loss = None if state.loss is None else float(state.loss)
        self.seen.append((state.micro_step, at_step_boundary(pl_module), loss, state.lr))


def test_training_step_writes_the_step_state(tmp_path: Path) -> None:
    module = _tiny_module(accumulation=3)
    assert module.step_state.tokens_per_step == 6 * 16 and module.step_state.accumulation == 3
    assert module.step_state.flops_per_token == flops_per_token(TINY, 16)
    data = [(torch.randint(0, 65, (2, 16)), torch.randint(0, 65, (2, 16))) for _ in range(6)]
    record = _Record()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None))  # type: ignore[arg-type]
    # Micro-steps 1, 2 are inside the step; the third ends it (micro_step back to 0) with the loss and lr set.
    assert [(m, b) for m, b, _, _ in record.seen] == [(1, False), (2, False), (0, True)] * 2
    assert record.seen[0][2] is None and record.seen[2][2] is not None and record.seen[5][2] is not None
    assert record.seen[2][3] == pytest.approx(OptimConfig(warmup_steps=0).lr)
    assert module.step_state.grad_norm is not None and float(module.step_state.grad_norm) > 0
    assert isinstance(module._sync, GradientSync) and type(module._sync) is GradientSync  # one process


def test_a_module_of_the_users_own_gets_a_state_from_what_it_declares() -> None:
    class Mine(pl.LightningModule):
        tokens_per_step = 512
        flops_per_token = 6e6

    state = step_state_of(Mine())
    assert (state.tokens_per_step, state.flops_per_token, state.accumulation) == (512, 6e6, 1)
    bare = step_state_of(pl.LightningModule())
    assert at_step_boundary(Mine()) and (bare.tokens_per_step, bare.flops_per_token) == (0, None)


def test_ddp_sync_reduces_only_on_the_last_micro_step() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        sync = gradient_sync(ddp)
        assert isinstance(sync, DDPSync) and not sync.divides_loss and not sync.clips
        sync.begin_micro_step(last=False)
        assert ddp.require_backward_grad_sync is False
        sync.begin_micro_step(last=True)
        assert ddp.require_backward_grad_sync is True
    finally:
        ddp = sync = None  # let go before leaving (also after a failed assertion)
        assert leave_process_group() == 0  # this pytest worker lives on: no gloo threads left behind in it
