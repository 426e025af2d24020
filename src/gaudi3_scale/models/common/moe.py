"""Mixture-of-experts feed-forward, Mixtral style (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088).

Routing is the semantics of transformers' `MixtralSparseMoeBlock` (models/mixtral/modeling_mixtral.py, 5.23):
a bias-free linear router gives E logits per token; their softmax (in fp32) picks the top-k experts, and the k
chosen probabilities, renormalised to sum to 1 (= a softmax over the k chosen logits), weight the experts' outputs.

Capacity: dropless. Every token is processed by all of its top-k experts, whatever the load; there is no capacity
factor and no token is dropped or padded (as Mixtral and MegaBlocks, Gale et al. 2022, arXiv:2211.15841). An
expert's batch is as large as the router makes it.

Layout: each projection is ONE batched weight over the experts — w1, w3 [E, dim, hidden], w2 [E, hidden, dim]
(torchtitan's `GroupedExperts` layout), so expert parallelism can later shard dim 0. The forward sorts the
(token, choice) pairs by expert and runs one matmul per expert on its contiguous slice — no per-token Python loop.

Losses, recorded on the module at each training forward (`aux_loss`, `z_loss`) and added to the objective by the
training step (`train.module`), averaged over the MoE layers:
* load balancing (Fedus et al. 2021, "Switch Transformers", arXiv:2101.03961, eq. 4-6): E · Σ_i f_i · P_i, with
  f_i the fraction of tokens that have expert i among their top-k and P_i the mean router probability of i. This
  is what transformers' `load_balancing_loss_func` computes for one layer (its f sums to k, so perfect balance
  gives k, not 1); it pools all layers into one f and P, where we average the per-layer values (as Switch does).
* router z-loss (Zoph et al. 2022, "ST-MoE", arXiv:2202.08906, eq. 5): mean over tokens of logsumexp(logits)².
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gaudi3_scale.models.common.norms import build_dropout
from gaudi3_scale.models.config import ModelConfig

__all__ = [
    "GroupedExperts",
    "MoEFeedForward",
    "RouterLosses",
    "load_balancing_loss",
    "route",
    "router_losses",
    "run_experts_eagerly_under_compile",
]


class GroupedExperts(nn.Module):
    """E SwiGLU experts, w2(silu(x w1) · x w3), stored as one [E, ...] tensor per projection (no bias)."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        if not self.w1.is_meta:  # built on meta: `Transformer.to_empty` wraps it when the weights get storage
            run_experts_eagerly_under_compile()

    # Eager under torch.compile: the per-expert row counts change every step, and a compiled graph would specialise
    # on them and recompile each time (moe-tiny, CPU, torch 2.13: 5.5 s a step, against 0.06 s with this). Around
    # this call the graph breaks once; the router and the rest of the block stay compiled. `torch.compiler.disable`
    # is applied when the first instance with real weights is built or materialized from meta
    # (`run_experts_eagerly_under_compile`), not as a decorator: it imports torch._dynamo (~1 s), which the commands
    # that only build a model on meta to read its shape (plan, tune --estimate-only, the launcher's forecast) never
    # need.
    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [N, dim] rows sorted by expert, `counts[e]` rows for expert e → [N, dim] in the same order."""
        # unbind: one view per expert whose backward stacks the E gradients once; indexing w1[e] would allocate
        # and add a zero-filled [E, dim, hidden] gradient per expert.
        outs = [
            (F.silu(rows @ w1) * (rows @ w3)) @ w2
            for rows, w1, w3, w2 in zip(
                x.split(counts.tolist()), self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0), strict=True
            )
        ]
        return torch.cat(outs)


def run_experts_eagerly_under_compile() -> None:
    """Wrap GroupedExperts.forward in `torch.compiler.disable` once, before any instance can run or be compiled."""
    if "_eager_under_compile" not in GroupedExperts.__dict__:
        forward = GroupedExperts.__dict__["forward"]
        GroupedExperts.forward = torch.compiler.disable(forward)  # type: ignore[method-assign]
        GroupedExperts._eager_under_compile = True  # type: ignore[attr-defined]


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (fp32 probabilities [T, E], weights [T, k] summing to 1, expert ids [T, k])."""
    probs = logits.float().softmax(dim=-1)
    top, experts = probs.topk(k, dim=-1)
    return probs, top / top.sum(dim=-1, keepdim=True), experts


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """E · Σ_i f_i · P_i for one layer: `probs` [T, E] router probabilities, `counts` [E] top-k assignments per
    expert (f_i = counts_i / T; k at perfect balance, see the module docstring). Gradients flow through P only."""
    tokens, num_experts = probs.shape
    return num_experts * torch.dot(counts.to(probs.dtype) / tokens, probs.mean(dim=0))


class RouterLosses(NamedTuple):
    aux: torch.Tensor  # load balancing, mean over the MoE layers
    z: torch.Tensor  # router z-loss, mean over the MoE layers


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts in place of the Llama MLP: `router` (dim → E) and `experts`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.num_experts is not None, "a dense config has no experts"
        self.num_experts, self.top_k = cfg.num_experts, cfg.experts_per_token
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.hidden_dim)
        self.dropout = build_dropout(cfg.dropout)
        self.aux_loss: torch.Tensor | None = None  # this layer's, from the last training forward
        self.z_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.top_k
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        probs, weights, experts = route(logits, k)
        flat = experts.flatten()  # (token, choice) pairs, token-major
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.training:
            self.aux_loss = load_balancing_loss(probs, counts)
            self.z_loss = torch.logsumexp(logits.float(), dim=-1).square().mean()
        else:
            self.aux_loss = self.z_loss = None
        order = flat.argsort(stable=True)  # pairs grouped by expert; stable keeps token order within one
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        # index_select, not x[idx]: its backward is index_add, where indexing's (index_put with accumulate) was
        # slower on CPU (torch 2.13).
        out = self.experts(x.index_select(0, order // k), counts)
        # Back to (token, choice) order, then each token's weighted sum of its k expert outputs: [T,1,k] @ [T,k,d].
        pairs = out.index_select(0, unsort).view(-1, k, shape[-1])
        y = torch.bmm(weights.to(pairs.dtype).unsqueeze(1), pairs)
        return self.dropout(y.view(shape))


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE feed-forwards of a `Transformer`'s blocks, in order (empty for a dense model)."""
    blocks = getattr(model, "layers", ())
    return [b.feed_forward for b in blocks if isinstance(getattr(b, "feed_forward", None), MoEFeedForward)]


def router_losses(layers: list[MoEFeedForward]) -> RouterLosses:
    """Mean over `layers` of the losses of their last training forward (call after the forward)."""
    aux = [layer.aux_loss for layer in layers]
    z = [layer.z_loss for layer in layers]
    if not layers or any(t is None for t in aux + z):
        raise ValueError("router losses exist after a training-mode forward of a model with MoE layers")
    return RouterLosses(torch.stack(aux).mean(), torch.stack(z).mean())  # type: ignore[arg-type]
