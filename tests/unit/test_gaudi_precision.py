"""GaudiMixedPrecision and GaudiOptimizer.FusedAdamW off Gaudi: real Lightning training on CPU, real optimizer steps."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from gaudi3_scale.device import optim as device_optim
from gaudi3_scale.device import precision as device_precision
from gaudi3_scale.device.hpu import hpu_available
from gaudi3_scale.precision import GaudiMixedPrecision
from gaudi3_scale.train.config import OptimConfig
from gaudi3_scale.train.optim import build_optimizer

pytestmark = pytest.mark.skipif(hpu_available(), reason="checks the behaviour without Gaudi")


class _TinyRegression(pl.LightningModule):
    """Records the dtype its Linear produced and the loss of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.output_dtypes: list[torch.dtype] = []
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.linear(x)
        self.output_dtypes.append(out.dtype)
        loss = F.mse_loss(out.float(), y.float())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g))
        return DataLoader(data, batch_size=4)


def _fit(plugin: GaudiMixedPrecision, tmp_path: Path) -> tuple[pl.Trainer, _TinyRegression]:
    torch.manual_seed(0)
    model = _TinyRegression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
        # Lightning 2.6 calls a pytree API that newer torch deprecates (filtered the same way in train/trainer.py).
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
        trainer.fit(model)
    return trainer, model


@pytest.mark.parametrize(
    ("precision", "output_dtype", "weight_dtype"),
    [
        ("bf16-mixed", torch.bfloat16, torch.float32),  # autocast: bf16 matmuls, fp32 master weights
        ("bf16-true", torch.bfloat16, torch.bfloat16),
        ("32-true", torch.float32, torch.float32),
    ],
)
def test_lightning_trainer_on_cpu_runs_in_the_requested_precision(
    precision: str, output_dtype: torch.dtype, weight_dtype: torch.dtype, tmp_path: Path
) -> None:
    plugin = GaudiMixedPrecision(precision)  # type: ignore[arg-type]
    trainer, model = _fit(plugin, tmp_path)
    assert trainer.precision_plugin is plugin and trainer.precision == precision
    assert model.output_dtypes == [output_dtype] * 3
    assert len(model.losses) == 3 and all(math.isfinite(loss) for loss in model.losses)
    assert model.linear.weight.dtype == weight_dtype
    torch.manual_seed(0)
    initial = _TinyRegression()
    assert not torch.equal(model.linear.weight.float(), initial.linear.weight), "the optimizer never stepped"


def test_autocast_follows_the_model_device_and_cache_option() -> None:
    plugin = GaudiMixedPrecision(cache_fp32_weights=True)
    with pytest.raises(RuntimeError, match="does not know the model yet"), plugin.forward_context():
        pass
    plugin.convert_module(nn.Linear(2, 2))
    assert plugin.autocast_device_type() == "cpu"
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.is_autocast_cache_enabled()
    assert not torch.is_autocast_enabled("cpu")
    plugin = GaudiMixedPrecision()
    plugin.convert_module(nn.Linear(2, 2))
    with plugin.forward_context():
        assert not torch.is_autocast_cache_enabled()  # Lightning's default


def test_options_without_effect_warn_once_per_option() -> None:
    device_precision._WARNINGS.clear()  # the cache is per process; start this test from a clean one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GaudiMixedPrecision()
        GaudiMixedPrecision(cache_fp32_weights=True)  # takes effect under bf16-mixed: no warning
        assert caught == []
        for _ in range(3):
            GaudiMixedPrecision(optimize_bmm=True, use_fused_rope=True, use_flash_attention_v2=True)
            GaudiMixedPrecision("32-true", cache_fp32_weights=True)
            GaudiMixedPrecision("bf16-true", cache_fp32_weights=True)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 4, messages
    for option in ("optimize_bmm", "use_fused_rope", "use_flash_attention_v2", "cache_fp32_weights"):
        assert sum(f"({option}=True)" in m for m in messages) == 1, (option, messages)
    assert all(w.category is UserWarning for w in caught)
    plugin = GaudiMixedPrecision(use_fused_rope=True)
    assert plugin.use_fused_rope is True  # the request is recorded


def test_bad_precision_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"'16-mixed'.*allowed: bf16-mixed, bf16-true, 32-true$"):
        GaudiMixedPrecision("16-mixed")  # type: ignore[arg-type]


def _train(optimizer_factory: object, steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = optimizer_factory(groups)  # type: ignore[operator]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_on_cpu_is_torch_fused_adamw_bit_for_bit() -> None:
    from gaudi3_scale import GaudiOptimizer

    assert GaudiOptimizer is device_optim.GaudiOptimizer
    kwargs = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-7}
    opt = GaudiOptimizer.FusedAdamW(nn.Linear(2, 2).parameters(), use_habana=False, **kwargs)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    ours = _train(lambda groups: GaudiOptimizer.FusedAdamW(groups, use_habana=False, **kwargs))
    reference = _train(lambda groups: torch.optim.AdamW(groups, fused=True, **kwargs))
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
    # Same algorithm as torch's default (for-loop) AdamW; the fused kernel only rounds differently.
    loop = _train(lambda groups: torch.optim.AdamW(groups, **kwargs))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ours, loop, strict=True))
    untouched = _train(lambda groups: torch.optim.AdamW(groups, **kwargs), steps=0)
    assert not any(torch.equal(a, b) for a, b in zip(ours, untouched, strict=True))


def test_fused_adamw_warns_once_without_gaudi() -> None:
    from gaudi3_scale import GaudiOptimizer

    device_optim._WARNINGS.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GaudiOptimizer.FusedAdamW(nn.Linear(2, 2).parameters(), use_habana=False)
        assert caught == []
        for _ in range(3):
            opt = GaudiOptimizer.FusedAdamW(nn.Linear(2, 2).parameters(), lr=1e-3)
    assert [str(w.message) for w in caught] == [
        "GaudiOptimizer.FusedAdamW(use_habana=True): no Gaudi (HPU) is usable here; using torch.optim.AdamW"
    ]
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True


def test_fused_adamw_keeps_an_explicit_kernel_choice() -> None:
    from gaudi3_scale import GaudiOptimizer

    opt = GaudiOptimizer.FusedAdamW(nn.Linear(2, 2).parameters(), use_habana=False, foreach=True)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_build_optimizer_routes_hpu_through_gaudi_optimizer_with_the_same_groups() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    device_optim._WARNINGS.clear()
    with pytest.warns(UserWarning, match=r"^GaudiOptimizer.FusedAdamW\(use_habana=True\): no Gaudi"):
        # The parameters are on CPU here, so the fallback is built; on Gaudi it would be Habana's FusedAdamW.
        opt = build_optimizer(model, OptimConfig(weight_decay=0.1), device_type="hpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.dim() for p in decay["params"]} == {2} and {p.dim() for p in no_decay["params"]} == {1}


def test_import_stays_light() -> None:
    code = "import sys, gaudi3_scale; assert 'torch' not in sys.modules and 'lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
