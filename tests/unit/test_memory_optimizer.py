"""`MemoryOptimizer`: activation checkpointing measurably lowers peak memory and keeps gradients; the batch split
accumulates the whole batch's gradient; Gaudi-only options stop with one line off Gaudi."""

from __future__ import annotations

import re
from collections import namedtuple
from dataclasses import replace

import pytest
import torch
from torch import nn

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.device.hpu import hpu_available
from gaudi3_scale.distributed.parallelize import find_blocks
from gaudi3_scale.memory import MemoryOptimizer
from gaudi3_scale.models import build_model, get_model_config
from gaudi3_scale.profiler import GaudiProfiler

# Activations dominate: 4 blocks of width 128 at context 256, 16 sequences (weights ~0.8 M parameters).
CFG = replace(get_model_config("shakespeare-char").resolve_vocab(65), num_layers=4, dim=128, num_heads=4,
              context_length=256, dropout=0.0)  # fmt: skip


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _peak_and_grads(checkpointing: bool, batch: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    model = build_model(CFG, seed=0)
    MemoryOptimizer(enable_gradient_checkpointing=checkpointing).optimize_model(model)
    with GaudiProfiler(
        activities=["cpu", "memory"], schedule_wait=0, schedule_warmup=0, schedule_active=1
    ) as prof:
        _loss(model, batch).backward()
        prof.step()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return prof.peak_memory_bytes(), grads


# One recorded step and no warmup: the net allocation of one forward + backward from a clean start is the point.
@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_activation_checkpointing_lowers_measured_peak_memory_and_keeps_gradients() -> None:
    batch = torch.randint(0, 65, (16, CFG.context_length + 1), generator=torch.Generator().manual_seed(0))
    plain_peak, plain_grads = _peak_and_grads(False, batch)
    ckpt_peak, ckpt_grads = _peak_and_grads(True, batch)
    # Without checkpointing every block's activations live until backward; with it, one block's at a time.
    assert ckpt_peak < 0.6 * plain_peak, (ckpt_peak, plain_peak)
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_checkpointing_is_applied_once_and_names_stay() -> None:
    model = build_model(CFG, seed=0)
    names = [name for name, _ in model.named_parameters()]
    optimizer = MemoryOptimizer()
    optimizer.optimize_model(model)
    optimizer.optimize_model(model)  # a second call must not wrap the wrapper
    assert optimizer.checkpointed_blocks == CFG.num_layers
    assert [name for name, _ in model.named_parameters()] == names
    wrapped = model.layers[0].forward
    assert getattr(wrapped, "activation_checkpointed", False) and not hasattr(
        wrapped, "__wrapped__.__wrapped__"
    )


def test_blocks_are_found_in_other_models() -> None:
    class Gpt2Like(nn.Module):  # Hugging Face GPT-2 keeps its blocks in transformer.h
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict({"h": nn.ModuleList(nn.Linear(4, 4) for _ in range(3))})
            self.heads = nn.ModuleList([nn.Linear(4, 2), nn.ReLU()])  # mixed classes: not the blocks

    model = Gpt2Like()
    assert find_blocks(model) is model.transformer["h"]
    with pytest.raises(ValueError, match="Sequential has none"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_accumulation_gives_the_whole_batch_gradient() -> None:
    batch = torch.randint(0, 65, (8, 33), generator=torch.Generator().manual_seed(1))
    small = replace(CFG, context_length=32, num_layers=2)
    whole, split = build_model(small, seed=0), build_model(small, seed=0)
    _loss(whole, batch).backward()
    optimizer = MemoryOptimizer(enable_gradient_checkpointing=False, micro_batch_size=2, accumulation_steps=4)
    assert optimizer.trainer_kwargs() == {"accumulate_grad_batches": 4} and optimizer.batch_size == 8
    loss = optimizer.accumulate(split, batch, _loss)
    torch.testing.assert_close(loss, _loss(whole, batch).detach())
    for (name, a), (_, b) in zip(whole.named_parameters(), split.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    parts = optimizer.micro_batches({"x": batch, "y": (batch, batch)})
    assert len(parts) == 4 and torch.equal(parts[3]["y"][1], batch[6:8])


def test_a_named_tuple_batch_splits_and_a_batch_of_text_is_one_line() -> None:
    Batch = namedtuple("Batch", "tokens labels")
    batch = Batch(torch.arange(8).reshape(4, 2), torch.arange(4))
    parts = MemoryOptimizer(accumulation_steps=2).micro_batches(batch)
    assert [type(part) for part in parts] == [Batch, Batch]
    assert torch.equal(parts[1].tokens, batch.tokens[2:]) and torch.equal(parts[1].labels, batch.labels[2:])
    with pytest.raises(
        TypeError, match=r"a batch must be a tensor or a tuple/list/dict of tensors, got str$"
    ):
        MemoryOptimizer(accumulation_steps=2).micro_batches(
            {"x": torch.zeros(4, 3), "text": ["a", "b", "c", "d"]}
        )


@pytest.mark.parametrize(
    ("kwargs", "batch_size", "message"),
    [
        ({"micro_batch_size": 2, "accumulation_steps": 4}, 6, "a batch of 6 samples does not split into 4"),
        ({"accumulation_steps": 3}, 8, "pass batches of a multiple of 3"),
    ],
)
def test_a_batch_that_does_not_split_is_refused(
    kwargs: dict[str, int], batch_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryOptimizer(**kwargs).micro_batches(torch.zeros(batch_size, 3))


@pytest.mark.parametrize(
    "kwargs", [{"micro_batch_size": 0}, {"accumulation_steps": 0}, {"accumulation_steps": True}]
)
def test_bad_arguments_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        MemoryOptimizer(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"micro_batch_size": 2.5, "accumulation_steps": 2},
            "micro_batch_size must be an integer >= 1 or None, got 2.5",
        ),
        ({"micro_batch_size": 4.0}, "micro_batch_size must be an integer >= 1 or None, got 4.0"),
        ({"micro_batch_size": False}, "micro_batch_size must be an integer >= 1 or None, got False"),
        ({"accumulation_steps": 2.5}, "accumulation_steps must be an integer >= 1, got 2.5"),
        ({"accumulation_steps": "4"}, "accumulation_steps must be an integer >= 1, got '4'"),
    ],
)
def test_non_integer_sizes_are_refused_in_one_line(kwargs: dict[str, object], message: str) -> None:
    """2.5 passed the `< 1` test and then asked for "batches of 5.0" (refusing 5), or reached Lightning as
    accumulate_grad_batches=2.5; "4" failed on a TypeError from `<`."""
    with pytest.raises(UserInputError, match=f"^MemoryOptimizer: {re.escape(message)}$") as refused:
        MemoryOptimizer(enable_gradient_checkpointing=False, **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)


def test_numpy_integer_sizes_are_taken_as_ints() -> None:
    import numpy as np

    optimizer = MemoryOptimizer(micro_batch_size=np.int64(2), accumulation_steps=np.int64(3))  # type: ignore[arg-type]
    assert optimizer.trainer_kwargs() == {"accumulate_grad_batches": 3}
    assert type(optimizer.trainer_kwargs()["accumulate_grad_batches"]) is int
    assert optimizer.batch_size == 6
    assert [part.shape[0] for part in optimizer.micro_batches(torch.zeros(6, 3))] == [2, 2, 2]


@pytest.mark.skipif(hpu_available(), reason="checks the refusal off Gaudi")
def test_hpu_graphs_need_gaudi_and_leave_the_model_alone() -> None:
    model = build_model(replace(CFG, num_layers=1), seed=0)
    with pytest.raises(UserInputError, match="Gaudi \\(HPU\\) was requested but no HPU is usable here"):
        MemoryOptimizer(enable_hpu_graphs=True).optimize_model(model)
    assert not getattr(model.layers[0].forward, "activation_checkpointed", False)
