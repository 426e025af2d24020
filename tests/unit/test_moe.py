"""Mixture of experts: routing against a per-token loop and transformers' Mixtral block, the router losses by hand,
Mixtral 8x7B's published parameter counts, layout-independent init of the batched experts, config refusals."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.models import ModelConfig, build_model, count_parameters, flops_per_token, get_model_config
from gaudi3_scale.models.common.init import fill_normal
from gaudi3_scale.models.common.moe import (
    MoEFeedForward,
    load_balancing_loss,
    moe_layers,
    route,
    router_losses,
)


def _moe(**changes: object) -> MoEFeedForward:
    cfg = replace(get_model_config("moe-tiny"), dim=16, ffn_dim=24, **changes)  # type: ignore[arg-type]
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.3)
    return moe


def _expert(moe: MoEFeedForward, e: int, x: torch.Tensor) -> torch.Tensor:
    w = moe.experts
    return (F.silu(x @ w.w1[e]) * (x @ w.w3[e])) @ w.w2[e]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_routing_matches_a_per_token_loop(k: int) -> None:
    moe = _moe(experts_per_token=k)
    x = torch.randn(3, 10, 16)
    with torch.no_grad():
        y = moe(x)
    for t, token in enumerate(x.reshape(-1, 16)):
        probs = (moe.router.weight @ token).softmax(-1).detach()
        chosen = sorted(range(8), key=lambda e: -float(probs[e]))[:k]
        want = sum(probs[e] / probs[chosen].sum() * _expert(moe, e, token) for e in chosen)
        torch.testing.assert_close(y.reshape(-1, 16)[t], want, atol=1e-5, rtol=1e-5)
    probs, weights, experts = route(moe.router(x.reshape(-1, 16)), k)
    torch.testing.assert_close(weights.sum(-1), torch.ones(30))  # the k weights of a token sum to 1
    assert torch.equal(experts.sort(-1).values, probs.topk(k).indices.sort(-1).values)


def test_same_output_as_transformers_mixtral_block() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    moe = _moe()
    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=8))
    w = moe.experts
    with torch.no_grad():  # HF: fused [E, 2·hidden, dim] gate/up and [E, dim, hidden] down, Linear layout
        hf.gate.weight.copy_(moe.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([w.w1, w.w3], dim=2).transpose(1, 2))
        hf.experts.down_proj.copy_(w.w2.transpose(1, 2))
    x = torch.randn(2, 12, 16)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf.eval()(x), atol=1e-6, rtol=1e-5)


def test_load_balancing_loss_by_hand_and_as_transformers() -> None:
    # 4 tokens, 2 experts, top-1: expert 0 gets 3 tokens (f = .75, .25); mean probabilities P = .65, .35.
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    assert float(load_balancing_loss(probs, torch.tensor([3, 1]))) == pytest.approx(
        2 * (0.75 * 0.65 + 0.25 * 0.35)
    )
    # One layer, top-2 of 8: transformers' load_balancing_loss_func computes the same value.
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(40, 8)
    probs, _, experts = route(logits, 2)
    ours = load_balancing_loss(probs, torch.bincount(experts.flatten(), minlength=8))
    torch.testing.assert_close(ours, load_balancing_loss_func((logits,), 8, 2))


def test_a_uniform_router_gives_aux_k_and_z_log_e_squared() -> None:
    """Zero router weights: every probability is 1/E, so E·Σ f_i/E = Σ f_i = k, and logsumexp(0) = log E."""
    moe = _moe(experts_per_token=2)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe.train()(torch.randn(2, 5, 16))
    losses = router_losses([moe])
    assert losses.aux.item() == pytest.approx(2.0)
    assert losses.z.item() == pytest.approx(math.log(8) ** 2)
    moe.eval()(torch.randn(2, 5, 16))  # evaluation records none: no stale training value is added by mistake
    with pytest.raises(ValueError, match="training-mode forward"):
        router_losses([moe])


def test_mixtral_8x7b_has_its_published_parameter_counts() -> None:
    """46.7 B in total, 12.9 B per token: Mistral AI, "Mixtral of experts" (2023-12-11); the paper (arXiv:2401.04088)
    rounds them to 47 B and 13 B."""
    cfg = get_model_config("mixtral-8x7b")
    dim, ffn, layers, vocab = 4096, 14336, 32, 32000
    attention = 2 * dim * dim + 2 * dim * 1024  # wq, wo; wk, wv with 8 kv heads of 128
    experts = 8 * 3 * dim * ffn
    per_block = attention + experts + 8 * dim + 2 * dim  # + router, two RMSNorms
    total = layers * per_block + 2 * vocab * dim + dim
    assert count_parameters(cfg) == total == 46_702_792_704
    active = total - layers * 6 * 3 * dim * ffn  # 6 of the 8 experts idle
    assert count_parameters(cfg, active=True) == active == 12_879_925_248
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9
    # MFU and the cost planner count the FLOPs of the active parameters (the input embedding is a lookup).
    attention_flops = 12 * layers * 32 * 128 * 4096
    assert flops_per_token(cfg, 4096) == 6 * (active - vocab * dim) + attention_flops


def test_sharded_expert_init_equals_the_whole_tensor(tmp_path: Path) -> None:
    """fill_normal on 3-D expert weights: a Shard(0) DTensor on each of 2 ranks holds its rows of the whole init."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from gaudi3_scale.distributed.mesh import DP_SHARD, build_device_mesh
    from gaudi3_scale.distributed.teardown import leave_process_group

    whole = torch.empty(4, 3, 5)
    fill_normal(whole, 0.02, seed=7, name="layers.0.feed_forward.experts.w1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = build_device_mesh("cpu", world_size=1, tp_size=1, dp_replicate=1)[DP_SHARD]
        sharded = distribute_tensor(torch.zeros(4, 3, 5), mesh, [Shard(0)])
        fill_normal(sharded, 0.02, seed=7, name="layers.0.feed_forward.experts.w1")
        assert torch.equal(sharded.full_tensor(), whole)
    finally:
        mesh = sharded = None  # let go before leaving (also after a failed assertion)
        assert leave_process_group() == 0  # this pytest worker lives on: no gloo threads left behind in it
    model = build_model(get_model_config("moe-tiny").resolve_vocab(65), seed=3)
    experts = model.layers[1].feed_forward.experts
    assert experts.w1.std().item() == pytest.approx(0.02, rel=0.1)
    assert experts.w2.std().item() == pytest.approx(
        0.02 / math.sqrt(4), rel=0.1
    )  # residual: 1/sqrt(2·layers)
    assert len(moe_layers(model)) == 2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"experts_per_token": 9}, "experts_per_token: 9 is more than num_experts (8); allowed: 1 to 8"),
        ({"arch": "gpt2"}, "num_experts: mixture of experts is an option of arch llama, not gpt2"),
        ({"bias": True}, "bias: must be false with num_experts"),
        ({"moe_aux_loss_coef": -1.0}, "moe_aux_loss_coef"),
    ],
)
def test_bad_moe_configs_are_refused(changes: dict[str, object], message: str) -> None:
    fields = {**vars(get_model_config("moe-tiny")), **changes}
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel.ep_size", "3"], "parallel.ep_size: 3 does not divide model.num_experts (8) evenly"),
        (["--parallel.ep_size", "2"], "parallel.ep_size: expert parallel is not implemented yet; use 1"),
        (["--model.name", "llama-tiny", "--parallel.ep_size", "2"], "needs a mixture of experts"),
        (
            ["--parallel.tp_size", "2", "--parallel.nproc_per_node", "2"],
            "parallel.tp_size: tensor parallel of mixture-of-experts blocks is not implemented yet",
        ),
    ],
)
def test_parallel_layouts_moe_cannot_run_are_one_line_exit_2(
    gaudi3_cli: Callable[..., tuple[int, str, str]], tmp_path: Path, args: list[str], message: str
) -> None:
    code, _, err = gaudi3_cli("train", "--out", str(tmp_path), "--model.name", "moe-tiny", *args)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not any(tmp_path.iterdir())


# A fresh interpreter: what the shape-only commands import (plan, tune --estimate-only, the launcher's forecast),
# then a MoE block compiled (dynamo's eager backend: no C++ compiler) over batches whose experts get other row
# counts each time. The batched experts run eagerly under compile, so new counts never recompile the block.
_COMPILE_SCRIPT = """
import sys
import gaudi3_scale.forecast.report, gaudi3_scale.models.build
assert "torch._dynamo" not in sys.modules, "reading a model's shape imported torch._dynamo"
from dataclasses import replace
import torch
import torch._dynamo
from gaudi3_scale.models import get_model_config
from gaudi3_scale.models.common.moe import MoEFeedForward
cfg = replace(get_model_config("moe-tiny"), dim=16, ffn_dim=24)
torch.manual_seed(0)
moe = MoEFeedForward(cfg)
with torch.no_grad():
    for param in moe.parameters():
        param.normal_(0, 0.3)
compiled = torch.compile(moe, backend="eager", dynamic=False)
torch._dynamo.config.error_on_recompile = True
counts = set()
for seed in range(6):
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(compiled(x), moe(x))
    counts.add(tuple(torch.bincount(moe.router(x).topk(cfg.experts_per_token).indices.flatten(),
                                    minlength=cfg.num_experts).tolist()))
assert len(counts) > 1, counts
print("ok", len(counts))
"""


def test_the_batched_experts_run_eagerly_under_compile_and_shape_only_imports_skip_dynamo() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]
