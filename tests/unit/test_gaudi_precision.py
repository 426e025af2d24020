"""GaudiMixedPrecision and GaudiOptimizer.FusedAdamW off Gaudi: real Lightning training on CPU, real optimizer steps."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from gaudi3_scale.device import optim as device_optim
from gaudi3_scale.device import precision as device_precision
from gaudi3_scale.device.hpu import hpu_available
from gaudi3_scale.models.common.attention import Attention
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.precision import GaudiMixedPrecision
from gaudi3_scale.train.optim import build_optimizer
from gaudi3_scale.train.optim_config import OptimConfig

pytestmark = pytest.mark.skipif(hpu_available(), reason="checks the behaviour without Gaudi")


class _RegressionBody:
    """Records the dtype its Linear produced and the loss of every training step (a LightningModule of either
    Lightning namespace, mixed in below)."""

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


class _TinyRegression(_RegressionBody, pl.LightningModule):
    pass


def _fit_module(
    module: Any, plugin: GaudiMixedPrecision, tmp_path: Path, *, lightning: Any = pl, max_steps: int = 3
) -> Any:
    """`module` fitted on cpu by a Trainer of the `lightning` namespace that holds `plugin` itself."""
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    assert trainer.precision_plugin is plugin
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
        # Lightning 2.6 calls a pytree API that newer torch deprecates (filtered the same way in train/trainer.py).
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
        # torch says why it passed over an SDPA kernel (dropout on cpu) before falling back or refusing.
        warnings.filterwarnings(
            "ignore", message=r".*(kernel not used because|do not support non-zero dropout).*"
        )
        trainer.fit(module)
    return trainer


def _fit(plugin: GaudiMixedPrecision, tmp_path: Path) -> tuple[pl.Trainer, _TinyRegression]:
    torch.manual_seed(0)
    model = _TinyRegression()
    return _fit_module(model, plugin, tmp_path), model


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


def test_cache_option_without_autocast_warns_once() -> None:
    device_precision._WARNINGS.clear()  # the cache is per process; start this test from a clean one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GaudiMixedPrecision()
        GaudiMixedPrecision(
            cache_fp32_weights=True, use_flash_attention_v2=True
        )  # both take effect: no warning
        GaudiMixedPrecision(optimize_bmm=False, use_fused_rope=False)  # the seed's names, not requested
        assert caught == []
        for _ in range(3):
            GaudiMixedPrecision("32-true", cache_fp32_weights=True)
            GaudiMixedPrecision("bf16-true", cache_fp32_weights=True)
    assert [str(w.message) for w in caught] == [
        "GaudiMixedPrecision(cache_fp32_weights=True) has no effect unless precision='bf16-mixed': only autocast "
        "casts fp32 weights"
    ]


@pytest.mark.parametrize(
    ("option", "reason"),
    [
        ("optimize_bmm", r"there is nothing to switch on \(bmm already runs in bf16 under autocast"),
        ("use_fused_rope", r"no fused RoPE kernel is wired on any device"),
    ],
)
def test_kernel_options_without_a_kernel_are_refused_in_one_line(option: str, reason: str) -> None:
    with pytest.raises(
        ValueError, match=rf"^GaudiMixedPrecision\({option}=True\) is not supported: {reason}"
    ) as info:
        GaudiMixedPrecision(**{option: True})  # type: ignore[arg-type]
    assert "\n" not in str(info.value) and str(info.value).endswith("; leave it False")


class _Attention(pl.LightningModule):
    """The models' own attention layer; records which SDPA kernel each training step ran."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attention = Attention(ModelConfig(name="attention-test", dim=16, num_heads=2, dropout=dropout))
        self.kernels: list[set[str]] = []

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = self.attention(batch[0])
        self.kernels.append(
            {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}
        )
        return out.float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(
            TensorDataset(torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0))), batch_size=2
        )


def _fit_attention(plugin: GaudiMixedPrecision, dropout: float, tmp_path: Path) -> _Attention:
    module = _Attention(dropout)
    _fit_module(module, plugin, tmp_path, max_steps=2)
    return module


FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_flash_attention_option_holds_attention_to_the_flash_kernel(precision: str, tmp_path: Path) -> None:
    flash = _fit_attention(GaudiMixedPrecision(precision, use_flash_attention_v2=True), 0.0, tmp_path)  # type: ignore[arg-type]
    assert flash.kernels == [{FLASH_CPU}] * 2
    # Dropout: torch's cpu flash kernel has none, so torch falls back to its math kernel; with the option it may not.
    plain = _fit_attention(GaudiMixedPrecision(precision), 0.1, tmp_path)  # type: ignore[arg-type]
    assert plain.kernels == [{MATH}] * 2
    with pytest.raises(RuntimeError, match="No available kernel"):
        _fit_attention(GaudiMixedPrecision(precision, use_flash_attention_v2=True), 0.1, tmp_path)  # type: ignore[arg-type]


def test_flash_attention_option_is_refused_where_torch_has_no_flash_backend() -> None:
    plugin = GaudiMixedPrecision(use_flash_attention_v2=True)
    plugin.convert_module(nn.Linear(2, 2, device="meta"))  # a device without it, as hpu is for this option
    refused = r"^GaudiMixedPrecision\(use_flash_attention_v2=True\) is not supported on meta: .*allowed on: cuda, cpu$"
    with pytest.raises(ValueError, match=refused), plugin.forward_context():
        pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attention_option_on_cuda_runs_flash_attention_2() -> None:
    attention = Attention(ModelConfig(name="attention-test", dim=64, num_heads=2)).cuda()
    plugin = GaudiMixedPrecision(use_flash_attention_v2=True)
    plugin.convert_module(attention)
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
        plugin.forward_context(),
    ):
        attention(torch.randn(2, 8, 64, device="cuda"))
    assert "aten::_scaled_dot_product_flash_attention" in {e.key for e in prof.key_averages()}
    plugin = GaudiMixedPrecision("32-true", use_flash_attention_v2=True)
    plugin.convert_module(attention)
    refused = r"needs bf16 on cuda .*allowed with precision: bf16-mixed, bf16-true$"
    with pytest.raises(ValueError, match=refused), plugin.forward_context():
        pass


def test_the_seed_plugin_object_trains_under_pytorch_lightning(tmp_path: Path) -> None:
    import pytorch_lightning

    plugin = GaudiMixedPrecision("bf16-mixed")  # lightning.pytorch's, as `gaudi3_scale.precision` exports it
    model = type("_TinyRegression", (_RegressionBody, pytorch_lightning.LightningModule), {})()
    _fit_module(model, plugin, tmp_path, lightning=pytorch_lightning)
    assert model.output_dtypes == [torch.bfloat16] * 3 and model.linear.weight.dtype == torch.float32


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


def test_autocast_runs_on_the_device_of_the_forward_under_cpu_offload() -> None:
    # FSDP2 CPU offload keeps the parameter shards on the host and the buffers on the device the forward runs on;
    # 'meta' stands in for 'hpu' (CPU torch cannot allocate hpu tensors). Not yet validated on Gaudi hardware.
    offloaded = nn.Linear(4, 4)
    offloaded.register_buffer("rope", torch.zeros(4, device="meta"))
    plugin = GaudiMixedPrecision("bf16-mixed")
    plugin.convert_module(offloaded)
    assert plugin.autocast_device_type() == "meta"
    plugin.convert_module(nn.Linear(4, 4))
    assert plugin.autocast_device_type() == "cpu"
