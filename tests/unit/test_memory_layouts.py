"""The memory estimate under tensor parallel, HSDP and CPU offload: hand-computed cases on a Llama shape small enough
to count by hand, and the run config's own one-line refusals.

Sizes are written out term by term from the module docstring of `gaudi3_scale.tune.memory`; cuda is used so that
no empirical runtime term is added.
"""

from __future__ import annotations

import re

import pytest

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.models import ModelConfig, count_parameters, get_model_config
from gaudi3_scale.tune.layouts import check_layouts, tensor_parallel_sizes, tp_bytes_per_token
from gaudi3_scale.tune.memory import estimate_memory

# L=2 blocks, h=64, 4 query heads / 2 kv heads of 16, SwiGLU width 192, V=128, context 32, untied embedding/head.
LLAMA = ModelConfig(
    name="tiny-llama", arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, dim=64, ffn_dim=192,
    vocab_size=128, context_length=32, bias=False, tie_embeddings=False,
)  # fmt: skip
H, F, V, L, KV = 64, 192, 128, 2, 32
MATMULS = H * (2 * H + 2 * KV) + 3 * H * F  # wq, wo (h²), wk, wv (h·kv), w1, w3, w2 (h·f)
NORMS = 2 * H * L + H  # two RMSNorm weights per block, the final one
PSI = L * MATMULS + 2 * V * H + NORMS  # + embedding table and head
CUDA = {"precision": "32-true", "device_kind": "cuda"}
MICRO_1 = BatchPlan.from_micro_batch(1)


def _psi_per_tp_rank(tp: int) -> float:
    """Megatron's split: every matrix (embedding and head included) over tp, the norms whole."""
    return (PSI - NORMS) / tp + NORMS


def test_tiny_llama_count_by_hand() -> None:
    assert PSI == 2 * 49_152 + 2 * 8192 + 320 == 115_008
    assert count_parameters(LLAMA) == PSI


def test_tensor_parallel_halves_the_matrices_and_keeps_the_norms() -> None:
    one = estimate_memory(LLAMA, ParallelPlan.build(strategy="fsdp", world_size=1), MICRO_1, **CUDA)
    two = estimate_memory(
        LLAMA, ParallelPlan.build(strategy="fsdp", world_size=2, tp_size=2), MICRO_1, **CUDA
    )
    assert two.dp_shard == 1 and two.parameters == PSI
    assert one.optimizer_bytes == 8 * PSI  # fp32 AdamW moments
    assert two.optimizer_bytes == 8 * _psi_per_tp_rank(2) == 8 * ((PSI - 320) / 2 + 320)
    # with tp 2 and 2 shards on 4 ranks, FSDP divides what tensor parallel left
    four = estimate_memory(
        LLAMA, ParallelPlan.build(strategy="fsdp", world_size=4, tp_size=2), MICRO_1, **CUDA
    )
    assert four.optimizer_bytes == round(8 * _psi_per_tp_rank(2) / 2)


def test_tensor_parallel_splits_activations_but_not_the_gathered_linear_inputs() -> None:
    # Korthikanti §4.2.2 (sequence parallel): norms, attention and MLP tensors / tp; the all-gathered inputs of the
    # column-parallel linears are saved whole (DTensor). fp32, flash attention, no checkpointing, b=2, s=32.
    b, s = 2, 32
    sbh, sb = s * b * H, s * b
    norm_side = 4 * sbh * 4 + 2 * sb * 4  # RMSNorm input and x·rsqrt in fp32 (two norms), and their rstd
    linear_inputs = 2 * sbh * 4  # the normed inputs of attention and MLP
    mlp = 4 * s * b * F * 4  # w1 x, w3 x, silu(w1 x), the product
    attention = (2 * sbh + 2 * sb * KV) * 4 + b * 4 * s * 4  # q, out, k, v; fp32 log-sum-exp per head

    def activations(tp: int) -> float:
        layer = norm_side / tp + linear_inputs + (mlp + attention) / tp
        head_side = 2 * sbh * 4 / tp + sbh * 4  # final norm (sequence-parallel), the head's gathered input
        return L * layer + head_side

    for tp in (1, 2):
        plan = ParallelPlan.build(strategy="fsdp", world_size=tp, tp_size=tp)
        est = estimate_memory(LLAMA, plan, BatchPlan.from_micro_batch(b), **CUDA)
        assert est.activations_bytes == round(activations(tp))
        # loss parallel: the b·s·V logits' work is split over the vocabulary too
        assert est.workspace_bytes == round(max(3 * b * s * V * 4 / tp, b * s * V * 4 / tp + V * H * 4 / tp))
    assert activations(2) < activations(1) < 2 * activations(2)  # the gathered inputs stay whole


def test_hsdp_shards_over_one_replica_only() -> None:
    fsdp4 = estimate_memory(LLAMA, ParallelPlan.build(strategy="fsdp", world_size=4), MICRO_1, **CUDA)
    hsdp = estimate_memory(
        LLAMA, ParallelPlan.build(strategy="fsdp", world_size=8, dp_replicate=2), MICRO_1, **CUDA
    )
    assert hsdp.dp_shard == 4
    assert hsdp.optimizer_bytes == fsdp4.optimizer_bytes == 8 * PSI / 4
    assert hsdp.total_bytes == fsdp4.total_bytes
    every_rank = estimate_memory(LLAMA, ParallelPlan.build(strategy="fsdp", world_size=8), MICRO_1, **CUDA)
    assert every_rank.optimizer_bytes == 8 * PSI / 8 < hsdp.optimizer_bytes
    # one replica per rank: nothing sharded, as one process
    assert (
        estimate_memory(
            LLAMA, ParallelPlan.build(strategy="auto", world_size=8, dp_replicate=8), MICRO_1, **CUDA
        ).optimizer_bytes
        == 8 * PSI
    )


def test_fsdp_offload_all_moves_shards_gradients_and_optimizer_to_the_host() -> None:
    n = 4
    kept = estimate_memory(LLAMA, ParallelPlan.build(strategy="fsdp", world_size=n), MICRO_1, **CUDA)
    moved = estimate_memory(
        LLAMA, ParallelPlan.build(strategy="fsdp", world_size=n, offload="all"), MICRO_1, **CUDA
    )
    assert (moved.optimizer_bytes, moved.grads_bytes) == (0, 0)
    assert moved.params_bytes == kept.params_bytes - 4 * PSI / n  # only the gathered blocks and root stay
    assert moved.host_bytes == (4 + 4 + 8) * PSI / n  # fp32 shards, their gradients, AdamW m and v
    assert moved.total_bytes < kept.total_bytes and kept.host_bytes == 0


def test_zero_offload_moves_the_optimizer_state_and_fp32_gradients() -> None:
    n = 4
    kw = {"precision": "bf16-mixed", "device_kind": "cuda"}
    kept = estimate_memory(LLAMA, ParallelPlan.build(strategy="deepspeed_zero2", world_size=n), MICRO_1, **kw)
    zero2_offload = ParallelPlan.build(strategy="deepspeed_zero2", world_size=n, offload="optimizer")
    moved = estimate_memory(LLAMA, zero2_offload, MICRO_1, **kw)
    assert kept.optimizer_bytes == 12 * PSI / n and moved.optimizer_bytes == 0  # master, m, v: ZeRO's K = 12
    assert moved.host_bytes == (12 + 4) * PSI / n  # + the fp32 gradient partition the CPU step reads
    assert moved.params_bytes == 2 * PSI  # bf16 weights stay whole on the device under stage 2
    zero3 = estimate_memory(
        LLAMA, ParallelPlan.build(strategy="deepspeed_zero3", world_size=n, offload="all"), MICRO_1, **kw
    )
    assert zero3.host_bytes == (12 + 4 + 2) * PSI / n  # and the bf16 parameter partition (offload_param)


def test_offload_on_a_cpu_moves_nothing() -> None:
    kept, moved = (ParallelPlan.build(strategy="fsdp", world_size=2, offload=o) for o in ("none", "all"))
    kw = {"precision": "32-true", "device_kind": "cpu"}
    assert (
        estimate_memory(LLAMA, moved, MICRO_1, **kw).total_bytes
        == estimate_memory(LLAMA, kept, MICRO_1, **kw).total_bytes
    )
    assert estimate_memory(LLAMA, moved, MICRO_1, **kw).host_bytes == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "ddp", "world_size": 2, "tp_size": 2}, "parallel.tp_size: runs on an FSDP2 device mesh"),
        ({"strategy": "fsdp", "world_size": 4, "tp_size": 4}, "parallel.tp_size: 4 must divide model.num_kv_heads (2)"),
        ({"strategy": "fsdp", "world_size": 4, "dp_replicate": 3}, "parallel.dp_replicate: must divide"),
        ({"strategy": "fsdp", "world_size": 2, "offload": "optimizer"},
         "parallel.offload: optimizer needs parallel.strategy deepspeed_zero2, deepspeed_zero3, not fsdp"),
    ],
)  # fmt: skip
def test_layouts_the_run_config_refuses_are_refused_here(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        estimate_memory(LLAMA, ParallelPlan.build(**kwargs), MICRO_1, device_kind="cuda")
    with pytest.raises(
        ConfigError, match=r"^parallel\.tp_size: tensor parallel is implemented for arch llama"
    ):
        estimate_memory(
            get_model_config("gpt2-124m"),
            ParallelPlan.build(strategy="fsdp", world_size=2, tp_size=2),
            MICRO_1,
        )


def test_tensor_parallel_sizes_and_traffic() -> None:
    llama70 = get_model_config("llama3-70b")  # 64 heads, 8 kv heads
    assert tensor_parallel_sizes(llama70, 8) == [1, 2, 4, 8]
    assert tensor_parallel_sizes(LLAMA, 8) == [1, 2]  # 2 kv heads
    assert tensor_parallel_sizes(get_model_config("gpt2-124m"), 8) == [1]
    # 8 collectives of h bf16 values per block and token, (tp-1)/tp of them leave the rank
    assert tp_bytes_per_token(llama70, 8) == 8 * 80 * 8192 * 2 * 7 / 8
    assert tp_bytes_per_token(llama70, 1) == 0


def test_offload_is_tried_only_where_the_layout_does_not_fit_without_it() -> None:
    gpt2 = get_model_config("gpt2-124m")
    fsdp2 = ParallelPlan.build(strategy="fsdp", world_size=2)
    kept = estimate_memory(gpt2, fsdp2, MICRO_1, precision="bf16-mixed", device_kind="cuda")
    budget = kept.total_bytes + 1  # fsdp without checkpointing just fits
    checks = check_layouts(gpt2, world_size=2, per_node=8, device_kind="cuda", device_bytes=budget)
    by_layout = {(c.layout.strategy, c.layout.activation_checkpointing, c.layout.offload): c for c in checks}
    assert by_layout[("fsdp", False, "none")].fits
    assert ("fsdp", False, "all") not in by_layout  # fits already: no offload variant
    assert not by_layout[("ddp", False, "none")].fits
    assert "needs" in by_layout[("ddp", False, "none")].reason("h100-sxm")
    assert [c.fits for c in checks] == sorted((c.fits for c in checks), reverse=True)  # what fits comes first
    for strategy, ckpt, offload in by_layout:
        if offload != "none":
            assert not by_layout[(strategy, ckpt, "none")].fits
