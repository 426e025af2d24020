"""16-mixed (fp16 with a dynamic loss scale): the step clips the true gradients, not the scaled ones, records their
norm, and leaves a step whose scaled gradients overflowed to the scaler.

Lightning's MixedPrecision plugin with a CPU GradScaler runs the same code as on a GPU (our config refuses 16-mixed
on a CPU only because its fp16 matmuls are slow there). Its own `clip_gradients` in manual optimization clips the
scaled gradients (Lightning issue #18089) and refuses a fused AdamW, which was every 16-mixed run's first step."""

from __future__ import annotations

from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from gaudi3_scale.models import get_model_config
from gaudi3_scale.train.module import LanguageModel
from gaudi3_scale.train.optim_config import OptimConfig

CFG = replace(get_model_config("llama-tiny").resolve_vocab(65), num_layers=1)
TOKENS = torch.randint(0, 65, (4, 65), generator=torch.Generator().manual_seed(0))


def _true_grad_norm() -> float:
    """The first step's gradient norm, unscaled: fp16 autocast, no loss scale."""
    module = LanguageModel(CFG, OptimConfig(), max_steps=1)
    module.configure_model()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = module(TOKENS[:, :-1].contiguous(), TOKENS[:, 1:].contiguous())
    loss.backward()
    return float(torch.nn.utils.clip_grad_norm_(list(module.parameters()), float("inf")))


@pytest.mark.parametrize("implementation", ["fused", "foreach"])  # auto is fused on CPU and CUDA
def test_a_16_mixed_step_clips_and_records_the_unscaled_gradients(implementation: str) -> None:
    module = LanguageModel(CFG, OptimConfig(implementation=implementation, warmup_steps=0), max_steps=1)
    data = torch.utils.data.DataLoader([(t[:-1], t[1:]) for t in TOKENS], batch_size=4)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, plugins=[plugin], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, data)
    assert module.step_state.grad_norm is not None
    assert float(module.step_state.grad_norm) == pytest.approx(_true_grad_norm(), rel=1e-2)


def test_the_clip_is_at_the_scaled_norm_and_an_overflow_is_the_scalers() -> None:
    module = LanguageModel(CFG, OptimConfig(), max_steps=1)
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    module._clip_params = params
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    params[0].grad = torch.tensor([3.0, 0.0, 0.0]) * 1024  # true gradients: norm 5
    params[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0]) * 1024
    norm = module._clip(1.0, scaler)
    assert norm is not None and float(norm) == pytest.approx(5.0)
    clipped = torch.cat([p.grad for p in params]) / 1024  # what the scaler's unscale leaves: clipped at 1
    assert float(clipped.norm()) == pytest.approx(1.0, rel=1e-5)
    assert torch.allclose(clipped[:2], torch.tensor([0.6, 0.0])) and float(clipped[4]) == pytest.approx(0.8)
    params[0].grad = torch.tensor(
        [float("inf"), 0.0, 0.0]
    )  # overflowed: the scaler skips it and lowers the scale
    assert module._clip(1.0, scaler) is None
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0, 0.0, 0.0])
    assert float(module._clip(10.0, None)) == pytest.approx(5.0)  # no loss scale: the plain clip


def _pretend_gpu_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: stand in the torch.cuda queries plan_device makes, for a T4 (fp16 tensor cores, no bf16)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")


@pytest.mark.parametrize(
    ("strategy", "resolved"),
    [("ddp", "16-mixed"), ("fsdp", "32-true")],  # FSDP2 has no loss scaler: 16-mixed is refused by the config
)
def test_auto_precision_on_a_gpu_without_bf16_is_what_the_strategy_can_run(
    monkeypatch: pytest.MonkeyPatch, strategy: str, resolved: str
) -> None:
    from gaudi3_scale.train.config import build_run_config
    from gaudi3_scale.train.trainer import GaudiTrainer

    _pretend_gpu_without_bf16(monkeypatch)
    cfg = build_run_config(
        None, [("train.device", "cuda"), ("train.precision", "auto"), ("parallel.strategy", strategy)]
    )
    assert GaudiTrainer(cfg, progress=False)._plan_device().precision == resolved
