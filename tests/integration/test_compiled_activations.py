"""The compiled-activation terms of the memory estimate (`tune.activations.compiled_layer_bytes`) against what
torch.compile's own partitioner decides to save for backward, on CPU, for the model code the trainer compiles.

Inductor's partition function (its joint-graph passes, then the min-cut rematerialisation partitioner) runs on the
joint graph of `next_token_loss` / `masked_lm_loss` under the precision's autocast, exactly as `train.compile` traces
it; the forward and backward graphs are then run eagerly instead of being code-generated (the choice of what to
save is made before code generation), so each case takes seconds. The saved tensors are the forward graph's outputs
beyond the loss, minus the graph's inputs and the matmul weights' cast copies (the estimate counts those as
parameters). One block's bytes are the difference between a 2-block and a 1-block model: they must equal the
formula exactly; the whole (head side and logits included) must be within 5 %.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import Any

import pytest
import torch

from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.models import ModelConfig, build_model, get_model_config
from gaudi3_scale.train.module import masked_lm_loss, next_token_loss
from gaudi3_scale.tune.memory import estimate_activation_bytes

pytestmark = pytest.mark.integration

B, S = 2, 96
# Widths chosen apart from one another and from the token count (192), so that no tensor's shape is ambiguous.
LLAMA = replace(get_model_config("llama3.2-1b"), dim=160, num_heads=4, num_kv_heads=2, ffn_dim=448,
                vocab_size=1008, context_length=S)  # fmt: skip
GPT2 = replace(
    get_model_config("gpt2-124m"), dim=160, num_heads=4, vocab_size=1008, context_length=S, bias=False
)
BERT = replace(
    get_model_config("bert-base"), dim=160, num_heads=4, ffn_dim=448, vocab_size=1008, context_length=S
)

CASES = {
    "llama-bf16-mixed": (LLAMA, "bf16-mixed"),
    "llama-32-true": (LLAMA, "32-true"),
    "gpt2-bf16-mixed": (GPT2, "bf16-mixed"),
    # dropout on CPU: attention takes the math path (its probabilities and mask are saved), two masks per block
    "gpt2-dropout-bf16-mixed": (replace(GPT2, dropout=0.1, bias=True), "bf16-mixed"),
    "bert-bf16-mixed": (replace(BERT, dropout=0.0), "bf16-mixed"),
    "bert-dropout-bf16-mixed": (BERT, "bf16-mixed"),
}


def saved_activation_bytes(cfg: ModelConfig, precision: str) -> int:
    """Bytes of the tensors the partitioner keeps from forward to backward (module docstring)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    saved: list[Any] = []

    def spy(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        # Inside inductor's own compile the fake mode is installed (its dropout pass reads it); here, set it alike.
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            forward, backward = partition_fn(joint, joint_inputs, **kwargs)
        (outputs,) = [n.args[0] for n in forward.graph.nodes if n.op == "output"]
        saved.extend(n.meta.get("val") for n in outputs[1:] if n.op != "placeholder")
        return forward, backward

    def run_eagerly(graph: torch.fx.GraphModule, _inputs: Any) -> Any:
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=run_eagerly, bw_compiler=run_eagerly, partition_fn=spy,
                           decompositions=select_decomp_table())  # fmt: skip
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(cfg)
    weights = {tuple(p.shape) for p in model.parameters()} | {
        tuple(p.shape[::-1]) for p in model.parameters()
    }
    loss_fn = masked_lm_loss if cfg.arch == "bert" else next_token_loss
    step = torch.compile(functools.partial(loss_fn, model), backend=backend)
    tokens, targets = torch.randint(0, 1000, (B, S)), torch.randint(0, 1000, (B, S))
    if cfg.arch == "bert":
        targets[torch.rand(B, S) < 0.85] = -100  # the MLM loss reads the masked positions only
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
    )
    with autocast:
        loss = step(tokens, targets)
    loss.backward()
    assert saved, "the partitioner was not called"
    return sum(
        t.numel() * t.element_size()
        for t in saved
        if isinstance(t, torch.Tensor) and t.numel() > 1 and not (t.dim() == 2 and tuple(t.shape) in weights)
    )


def _estimate(cfg: ModelConfig, precision: str) -> int:
    return estimate_activation_bytes(cfg, ParallelPlan(compile=True), BatchPlan.from_micro_batch(B, context_length=S),
                                     precision=precision, device_kind="cpu")  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_block_is_what_the_partitioner_saves(case: str) -> None:
    cfg, precision = CASES[case]
    one, two = replace(cfg, num_layers=1), replace(cfg, num_layers=2)
    measured_one, measured_two = (
        saved_activation_bytes(one, precision),
        saved_activation_bytes(two, precision),
    )
    assert measured_two - measured_one == _estimate(two, precision) - _estimate(one, precision)
    # The whole: blocks, head side, and the logits the loss keeps (compute dtype; its gradient overwrites them).
    logits = B * S * cfg.vocab_size * (2 if precision == "bf16-mixed" else 4)
    whole = _estimate(two, precision) + logits
    assert whole == pytest.approx(measured_two, rel=0.05), (whole, measured_two)


def test_eager_saves_more_than_compiled() -> None:
    """What the estimate changes with train.compile: one cast per norm instead of one per reading linear, no
    fp32 log_softmax: at Llama 3.2 1B, micro-batch 8 × 2048, about a third fewer activations."""
    cfg = get_model_config("llama3.2-1b")
    batch = BatchPlan.from_micro_batch(8)
    eager, compiled = (
        estimate_activation_bytes(
            cfg, ParallelPlan(compile=c), batch, precision="bf16-mixed", device_kind="cuda"
        )
        for c in (False, True)
    )
    assert 0.6 < compiled / eager < 0.7, compiled / eager
