"""The analytic memory estimate: hand-computed cases, the papers' formulas, monotonicity, bad input.

Sizes below are written out term by term from the module docstring of `gaudi3_scale.tune.memory`; cuda is used where
the runtime baseline (empirical on CPU) would only add a constant.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.models import ModelConfig, build_model, count_parameters, get_model_config, list_models
from gaudi3_scale.tune.estimate_table import format_estimate_table
from gaudi3_scale.tune.memory import (
    CPU_DEEPSPEED_IMPORT_BYTES,
    CPU_RUNTIME_BYTES,
    estimate_activation_bytes,
    estimate_memory,
    max_micro_batch_that_fits,
)

# A GPT-2-shaped model small enough to count by hand: L=2, h=64, a=4, f=4h=256, V=128, context 32, tied, no biases.
TINY = ModelConfig(
    name="tiny", arch="gpt2", num_layers=2, num_heads=4, dim=64, vocab_size=128, context_length=32, bias=False
)
H, F, V, L, A = 64, 256, 128, 2, 4
BLOCK = 12 * H * H + 2 * H  # q, k, v, o: 4h²; MLP 8h²; two LayerNorm weights
ROOT = V * H + 32 * H + H  # tied token table/head, positions, final norm
PSI = L * BLOCK + ROOT
SINGLE = ParallelPlan.build()  # auto on one rank: one plain process
MICRO_1 = BatchPlan.from_micro_batch(1)  # one sequence of the model's context per forward pass


def _layer_fp32(b: int, s: int) -> int:
    """One GPT-2 block's saved activations in fp32 with fused attention (4 bytes per element)."""
    sbh, sbf, sb = s * b * H, s * b * F, s * b
    norms = 2 * sbh * 4 + 2 * 2 * sb * 4  # LayerNorm inputs x, x1; mean and rstd of both
    linear_inputs = 2 * sbh * 4  # ln_1(x) read by wq/wk/wv, ln_2(x1) read by w1
    attention = 4 * sbh * 4 + b * A * s * 4  # q, k, v, output; fp32 log-sum-exp
    mlp = 2 * sbf * 4  # GELU input, w2 input
    return norms + linear_inputs + attention + mlp


def test_tiny_parameter_count_by_hand() -> None:
    assert PSI == 108_864
    assert count_parameters(TINY) == PSI


def test_ddp_fp32_by_hand() -> None:
    b, s = 2, 32
    est = estimate_memory(
        TINY,
        ParallelPlan.build(strategy="ddp"),
        BatchPlan.from_micro_batch(b),
        precision="32-true",
        device_kind="cuda",
    )
    activations = L * _layer_fp32(b, s) + 2 * s * b * H * 4  # + final norm input and head input
    assert _layer_fp32(b, s) == 64 * s * b * H + 2048  # 16 fp32 tensors of s·b·h, plus the small statistics
    logits = b * s * V
    loss = max(3 * logits * 4, logits * 4 + V * H * 4)  # log_softmax out + its grad + logits grad
    start = 4 * PSI + 4 * PSI + 8 * PSI + activations + loss  # weights, bucket gradients, AdamW m and v
    end = 16 * PSI + 3 * V * H * 4  # the tied table's head gradient, embedding gradient and their sum
    assert start > end
    assert est.peak_phase == "backward start"
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == (4 * PSI, 4 * PSI, 8 * PSI)
    assert (est.activations_bytes, est.workspace_bytes, est.runtime_bytes) == (activations, loss, 0)
    assert est.total_bytes == start == 2_401_280


def test_single_process_gradients_do_not_overlap_activations() -> None:
    # auto on one rank is a plain process: gradients are set to None after each step, unlike DDP's buckets.
    batch = BatchPlan.from_micro_batch(2)
    est = estimate_memory(
        TINY, ParallelPlan.build(strategy="auto"), batch, precision="32-true", device_kind="cuda"
    )
    assert est.strategy == "single"
    assert est.grads_bytes == 0
    ddp = estimate_memory(
        TINY, ParallelPlan.build(strategy="ddp"), batch, precision="32-true", device_kind="cuda"
    )
    assert ddp.total_bytes - est.total_bytes == 4 * PSI


def test_runtime_baseline_is_added_on_cpu_only() -> None:
    ddp = ParallelPlan.build(strategy="ddp")
    cuda = estimate_memory(TINY, ddp, MICRO_1, precision="32-true", device_kind="cuda")
    cpu = estimate_memory(TINY, ddp, MICRO_1, precision="32-true", device_kind="cpu")
    assert cpu.total_bytes - cuda.total_bytes == CPU_RUNTIME_BYTES
    zero2 = ParallelPlan.build(strategy="deepspeed_zero2")
    zero = estimate_memory(TINY, zero2, MICRO_1, precision="32-true", device_kind="cpu")
    assert zero.runtime_bytes == CPU_RUNTIME_BYTES + CPU_DEEPSPEED_IMPORT_BYTES


def test_fsdp_at_four_ranks_by_hand() -> None:
    b, s, n = 8, 32, 4
    batch, same = BatchPlan.from_micro_batch(b), {"precision": "32-true", "device_kind": "cuda"}
    est = estimate_memory(TINY, ParallelPlan.build(strategy="fsdp", world_size=n), batch, **same)
    # Backward start: shards of weights and AdamW state, the root and two blocks gathered (current + prefetch).
    assert est.peak_phase == "backward start"
    assert est.params_bytes == 4 * PSI / n + 4 * (2 * BLOCK + ROOT)
    assert est.grads_bytes == 0
    assert est.optimizer_bytes == 8 * PSI / n
    assert est.activations_bytes == L * _layer_fp32(b, s) + 2 * s * b * H * 4
    # fsdp_grad_op keeps every block gathered from forward to backward: here both blocks, so the same.
    grad_op_plan = ParallelPlan.build(strategy="fsdp_grad_op", world_size=n)
    grad_op = estimate_memory(TINY, grad_op_plan, batch, **same)
    assert grad_op.total_bytes == est.total_bytes
    deep = replace(TINY, num_layers=6)
    all_blocks = estimate_memory(deep, grad_op_plan, batch, **same)
    two_blocks = estimate_memory(deep, ParallelPlan.build(strategy="fsdp", world_size=n), batch, **same)
    assert all_blocks.params_bytes - two_blocks.params_bytes == 4 * (6 - 2) * BLOCK


def test_zero2_model_states_follow_the_zero_paper() -> None:
    # ZeRO (arXiv:1910.02054) Fig. 1: stage 2 holds 2Ψ + (2 + K)Ψ/N_d with K = 12; DeepSpeed's step also flattens
    # the gradient partition into fp32 (4Ψ/N), which is this strategy's peak.
    n = 4
    est = estimate_memory(
        TINY, ParallelPlan.build(strategy="deepspeed_zero2", world_size=n), BatchPlan.from_micro_batch(1, context_length=8),
        precision="bf16-mixed", device_kind="cuda",
    )  # fmt: skip
    assert est.peak_phase == "optimizer step"
    assert est.params_bytes + est.grads_bytes + est.optimizer_bytes == 2 * PSI + 14 * PSI / n
    assert est.optimizer_bytes == 12 * PSI / n
    assert est.workspace_bytes == 4 * PSI / n


def test_zero3_model_states_follow_the_zero_paper() -> None:
    # Stage 3: 16Ψ/N_d, plus the parameters DeepSpeed keeps gathered: max_live_parameters = 24·h² (here more than
    # the whole model, so all of it) and 0.9·h² of prefetch off gloo.
    n = 4
    est = estimate_memory(
        TINY, ParallelPlan.build(strategy="deepspeed_zero3", world_size=n), BatchPlan.from_micro_batch(1, context_length=8),
        precision="bf16-mixed", device_kind="cuda",
    )  # fmt: skip
    live = min(PSI, 24 * H * H + int(0.9 * H * H)) * 2
    assert est.peak_phase == "backward start"
    assert est.params_bytes + est.grads_bytes + est.optimizer_bytes - live == 16 * PSI / n


def test_activations_per_layer_match_korthikanti_for_16_bit() -> None:
    # Korthikanti et al. (arXiv:2205.05198) §4.1: s·b·h·(34 + 5·a·s/h) bytes per layer in 16 bit. Flash attention
    # drops the 5·a·s/h score terms (keeping a fp32 log-sum-exp); with dropout the two 1-byte masks make up 34.
    b, s = 4, 32
    sbh = s * b * H

    def layer(cfg: ModelConfig) -> int:
        deeper, batch = replace(cfg, num_layers=3), BatchPlan.from_micro_batch(b)
        return estimate_activation_bytes(deeper, SINGLE, batch, precision="bf16-true", device_kind="cuda") - (
            estimate_activation_bytes(cfg, SINGLE, batch, precision="bf16-true", device_kind="cuda")
        )

    statistics = 2 * 2 * s * b * 2 + b * A * s * 4  # LayerNorm mean/rstd (bf16), the log-sum-exp (fp32)
    assert layer(TINY) == 32 * sbh + statistics
    assert layer(replace(TINY, dropout=0.1)) == 34 * sbh + statistics


def test_activation_checkpointing_keeps_layer_inputs_and_one_layer() -> None:
    b, s = 64, 32
    batch, kwargs = BatchPlan.from_micro_batch(b), {"precision": "32-true", "device_kind": "cuda"}
    deep = replace(TINY, num_layers=8)
    full = estimate_memory(deep, ParallelPlan.build(activation_checkpointing=False), batch, **kwargs)
    ckpt = estimate_memory(deep, ParallelPlan.build(activation_checkpointing=True), batch, **kwargs)
    head = 2 * s * b * H * 4
    assert full.activations_bytes == 8 * _layer_fp32(b, s) + head
    # Korthikanti §4: 2·s·b·h·L in 16 bit, here 4 bytes per element; plus the block recomputed in backward.
    assert ckpt.activations_bytes == 8 * s * b * H * 4 + _layer_fp32(b, s) + head
    assert ckpt.total_bytes < full.total_bytes


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_layer_formula_matches_the_tensors_autograd_saves(arch: str, precision: str) -> None:
    # Pins the per-layer formula to the real block: the unique storages autograd saves for one block's backward on
    # CPU, parameters and buffers excluded. Fails if the model code (or torch) changes what it keeps.
    llama = arch == "llama"
    cfg = replace(TINY, arch=arch, num_kv_heads=2 if llama else None, ffn_dim=192 if llama else None)
    b, s = 3, 16
    model = build_model(cfg, seed=0)
    x = torch.randn(b, s, cfg.dim, requires_grad=True)
    if precision == "bf16-true":  # Lightning's HalfPrecision: the module (buffers too) and its inputs in bf16
        model = model.to(torch.bfloat16)
        x = x.detach().to(torch.bfloat16).requires_grad_()
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    rope = model.rope_cache[:s] if model.rope_cache is not None else None
    # Lightning's MixedPrecision: autocast without the weight cache
    autocast = torch.autocast(
        "cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=precision == "bf16-mixed"
    )
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.layers[0](x, rope)
    batch = BatchPlan.from_micro_batch(b, context_length=s)
    formula = estimate_activation_bytes(
        replace(cfg, num_layers=3), SINGLE, batch, precision=precision
    ) - estimate_activation_bytes(cfg, SINGLE, batch, precision=precision)
    # Under autocast the bf16 copies of the block's matmul weights are saved too (the estimate counts them as params).
    kv_dim, ffn = 2 * 16, 192
    matmul_weights = H * (2 * H + 2 * kv_dim) + 3 * H * ffn if llama else 12 * H * H
    weight_casts = 2 * matmul_weights if precision == "bf16-mixed" else 0
    assert out.shape == (b, s, H)
    assert sum(saved.values()) == formula + weight_casts


@pytest.mark.parametrize("name", ["gpt2-124m", "llama3-8b"])
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_grad_op", "deepspeed_zero2", "deepspeed_zero3"])
def test_more_ranks_never_need_more_memory_per_rank(name: str, strategy: str) -> None:
    cfg = get_model_config(name)
    totals = [
        estimate_memory(
            cfg,
            ParallelPlan.build(strategy=strategy, world_size=n),
            MICRO_1,
            precision="bf16-mixed",
            device_kind="cuda",
        ).total_bytes
        for n in (1, 2, 4, 8, 64)
    ]
    assert totals == sorted(totals, reverse=True)
    assert totals[-1] < totals[0]


@pytest.mark.parametrize("name", ["gpt2-124m", "llama3-8b"])
@pytest.mark.parametrize("strategy", ["auto", "ddp", "fsdp", "deepspeed_zero3"])
def test_monotone_in_micro_batch_and_checkpointing_and_precision(name: str, strategy: str) -> None:
    cfg = get_model_config(name)
    layout = {"strategy": strategy, "world_size": 1 if strategy == "auto" else 8}
    plan = ParallelPlan.build(**layout)
    by_micro = [
        estimate_memory(cfg, plan, BatchPlan.from_micro_batch(m), device_kind="cuda").total_bytes
        for m in (1, 2, 4, 8)
    ]
    assert by_micro == sorted(by_micro) and by_micro[-1] > by_micro[0]
    for m in (1, 8):
        batch = BatchPlan.from_micro_batch(m)
        off = estimate_memory(
            cfg, ParallelPlan.build(**layout, activation_checkpointing=False), batch, device_kind="cuda"
        )
        on = estimate_memory(
            cfg, ParallelPlan.build(**layout, activation_checkpointing=True), batch, device_kind="cuda"
        )
        assert on.total_bytes <= off.total_bytes
    true16 = estimate_memory(cfg, plan, MICRO_1, precision="bf16-true", device_kind="cuda")
    fp32 = estimate_memory(cfg, plan, MICRO_1, precision="32-true", device_kind="cuda")
    assert true16.total_bytes < fp32.total_bytes


def test_llama3_70b_on_gaudi3_sanity() -> None:
    cfg = get_model_config("llama3-70b")
    psi = 70_553_706_496
    gaudi3 = 128 * 10**9  # device/specs.py: 128 GB HBM2e
    hpu = {"precision": "bf16-mixed", "device_kind": "hpu"}
    est = estimate_memory(cfg, ParallelPlan.build(strategy="fsdp", world_size=8), MICRO_1, **hpu)
    assert est.optimizer_bytes == 8 * psi / 8  # fp32 AdamW moments, sharded
    # 16 bytes per parameter of sharded fp32 state alone exceed a Gaudi 3 on 8 ranks, whatever the strategy …
    assert 16 * psi / 8 > gaudi3
    for strategy in ("ddp", "fsdp", "fsdp_grad_op", "deepspeed_zero2", "deepspeed_zero3"):
        plan = ParallelPlan.build(strategy=strategy, world_size=8, activation_checkpointing=True)
        assert max_micro_batch_that_fits(cfg, plan, budget_bytes=gaudi3, **hpu) == 0
    # … while 16 ranks of FSDP with activation checkpointing fit one 8192-token sequence, and ddp never does.
    fsdp16, ddp16 = (
        ParallelPlan.build(strategy=strategy, world_size=16, activation_checkpointing=True)
        for strategy in ("fsdp", "ddp")
    )
    assert max_micro_batch_that_fits(cfg, fsdp16, budget_bytes=gaudi3, **hpu) >= 1
    assert max_micro_batch_that_fits(cfg, ddp16, budget_bytes=gaudi3, **hpu) == 0
    table = format_estimate_table(
        cfg, world_size=8, precision="bf16-mixed", device_kind="hpu", device_memory_bytes=gaudi3
    )
    lines = table.splitlines()
    assert lines[0].startswith("llama3-70b: 70.6 B parameters, 8 rank(s), micro-batch 1 × 8192 tokens")
    assert (
        len([line for line in lines if line.endswith("no (0)")]) == 10
    )  # 5 strategies × checkpointing off/on


def test_max_micro_batch_is_the_largest_that_fits() -> None:
    ddp, kwargs = ParallelPlan.build(strategy="ddp"), {"precision": "32-true", "device_kind": "cuda"}
    budget = estimate_memory(TINY, ddp, BatchPlan.from_micro_batch(37), **kwargs).total_bytes
    assert estimate_memory(TINY, ddp, BatchPlan.from_micro_batch(38), **kwargs).total_bytes > budget
    assert max_micro_batch_that_fits(TINY, ddp, budget_bytes=budget, **kwargs) == 37
    assert max_micro_batch_that_fits(TINY, ddp, budget_bytes=budget - 1, **kwargs) == 36
    assert max_micro_batch_that_fits(TINY, ddp, budget_bytes=10**15, limit=100, **kwargs) == 100
    assert max_micro_batch_that_fits(TINY, ddp, budget_bytes=1000, **kwargs) == 0


def test_auto_choices_resolve_like_the_trainer() -> None:
    assert estimate_memory(TINY, ParallelPlan.build(strategy="auto", world_size=2), MICRO_1).strategy == "ddp"
    # one HPU still runs through the HCCL DDP strategy (ParallelPlan.runs_as)
    assert estimate_memory(TINY, SINGLE, MICRO_1, device_kind="hpu").strategy == "ddp"
    assert estimate_memory(TINY, SINGLE, MICRO_1, device_kind="cpu").precision == "32-true"
    assert estimate_memory(TINY, SINGLE, MICRO_1, device_kind="cuda").precision == "bf16-mixed"


def test_every_registry_model_is_estimated() -> None:
    for name in list_models():
        cfg = get_model_config(name)
        cfg = cfg if cfg.vocab_size is not None else cfg.resolve_vocab(65)
        fsdp8 = ParallelPlan.build(strategy="fsdp", world_size=8)
        assert estimate_memory(cfg, fsdp8, MICRO_1, device_kind="cuda").total_bytes > 0


@pytest.mark.parametrize(
    ("plan", "batch", "kwargs", "error", "message"),
    [
        # the ranks and the strategy are the plan's: refused as it is built, as a run config refuses them
        ({"world_size": 0}, {}, {}, UserInputError, "world_size must be a positive number of ranks, got 0"),
        ({"strategy": "zero9"}, {}, {}, ConfigError, "parallel.strategy: must be one of auto, ddp"),
        ({}, {}, {"precision": "int8"}, ConfigError, "train.precision: must be one of"),
        ({}, {}, {"precision": "fp8", "device_kind": "cpu"}, ConfigError, "train.precision: fp8 needs cuda"),
        (
            {},
            {},
            {"precision": "16-mixed", "device_kind": "cpu"},
            ConfigError,
            "train.precision: 16-mixed needs cuda",
        ),
        ({}, {}, {"device_kind": "tpu"}, ConfigError, "train.device: must be one of cpu, cuda, hpu"),
        ({}, {"micro_batch_size": 0}, {}, ConfigError, "train.micro_batch_size: must be a positive integer"),
        (
            {},
            {"context_length": 33},
            {},
            ConfigError,
            "model.context_length: must be between 1 and the model's 32",
        ),
        ({}, {}, {"optimizer": "sgd"}, UserInputError, "unknown optimizer 'sgd'; valid: adamw"),
    ],
)
def test_bad_input_is_one_line(
    plan: dict, batch: dict, kwargs: dict, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match="^" + re.escape(message)):
        estimate_memory(
            TINY,
            ParallelPlan.build(**plan),
            BatchPlan.from_micro_batch(**{"micro_batch_size": 1, **batch}),
            **kwargs,
        )


def test_unresolved_vocabulary_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: is null"):
        estimate_memory(get_model_config("shakespeare-char"), SINGLE, MICRO_1)


def test_table_rows_and_auto_strategy() -> None:
    gpt2 = get_model_config("gpt2-124m")
    table = format_estimate_table(gpt2, world_size=1, strategies=("auto", "fsdp"), device_kind="cuda")
    rows = [line.split() for line in table.splitlines()[2:-1]]
    assert [(r[0], r[1]) for r in rows] == [
        ("single", "off"),
        ("single", "on"),
        ("fsdp", "off"),
        ("fsdp", "on"),
    ]
    single = estimate_memory(gpt2, ParallelPlan.build(strategy="auto"), MICRO_1, device_kind="cuda")
    assert single.total_bytes > 2**30  # so that the two-decimal GiB below says something
    assert rows[0][8] == f"{single.total_bytes / 2**30:.2f}"
