"""What `train.precision fp8` is expected to gain over bf16-mixed for a model, so the tuner proposes fp8 only where
it can pay (`MIN_FP8_GAIN`).

Amdahl over a step: gain = 1 / (1 − share · k).
* share: the fraction of a token's training FLOPs (`models.counting`: 6·N + attention) done by the linears fp8
  converts (`device.float8.convertible_linears`: sizes multiples of 16, the head only with `Float8Plan.head`) that
  torchao's H100 GEMM tables expect to be faster in fp8 than in bf16 (the size thresholds behind its
  `_auto_filter_for_recipe`, torchao 0.18 README "Performance"; `device.float8.SKIP_SMALL_RECIPES`). A linear
  expected to be slower counts for nothing, converted or not.
* k: the fraction of a converted FLOP's time fp8 saves, measured once and held here (`FP8_TIME_SAVED`): Llama 3.2 1B,
  micro-batch 8 × 2048, compiled, tensorwise with the head in fp8 ran at 1.229× bf16's tokens/s on one H200
  (`benchmarks/results/gpu_shapes_cuda_h200.json`, 2026-11-28), where this module's share is 0.877. The two runs
  came from two separate calls of one lease (bf16 on a cold machine, fp8 on a warm one), not side by side: k is
  to be measured again side by side (issue #42).

So the model can only say where fp8 cannot pay (share too small), not promise a gain elsewhere: it is fitted on one
shape of one GPU. Not modelled: a mixture of experts' grouped experts (not `nn.Linear`, never converted), and
attention, norms and the loss, which stay in bf16 and are what keeps the gain below 1 / (1 − k) ≈ 1.27.
"""

from __future__ import annotations

from dataclasses import dataclass

from gaudi3_scale.device.float8 import Float8Plan, convertible_linears
from gaudi3_scale.models.config import ModelConfig

__all__ = ["FP8_TIME_SAVED", "MIN_FP8_GAIN", "Fp8Gain", "fast_in_fp8", "fp8_gain"]

# (1 − 1/1.2285) / 0.8775: the measured Llama 3.2 1B shape (module docstring); tests/unit/test_fp8_gain.py recomputes it
# from the stored result.
FP8_TIME_SAVED = 0.2120
# Below this the tuner leaves fp8 out of its precisions: inside the run-to-run noise of a trial, not worth the risk.
MIN_FP8_GAIN = 1.05


@dataclass(frozen=True)
class Fp8Gain:
    share: float  # of a token's training FLOPs, in linears fp8 speeds up
    gain: float  # modelled tokens/s over bf16-mixed's
    converted: int  # linears apply_float8 would convert
    fast: int  # of those, the ones torchao's tables expect to be faster in fp8

    @property
    def pays(self) -> bool:
        return self.gain >= MIN_FP8_GAIN


def fast_in_fp8(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether torchao's H100 GEMM tables expect this linear (weight out × in) to be faster in fp8 than in bf16:
    tensorwise not when in <= 4096 and out <= 1024; rowwise not when out <= 2048, in <= 1024, or out <= 4096 and in
    <= 2048 (torchao 0.18 `_auto_filter_for_recipe`); rowwise_with_gw_hp has no table: every linear counts."""
    if recipe == "tensorwise":
        return not (in_features <= 4096 and out_features <= 1024)
    if recipe == "rowwise":
        return not (
            out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048)
        )
    return True


def fp8_gain(cfg: ModelConfig, plan: Float8Plan, context_length: int | None = None) -> Fp8Gain:
    """The modelled gain of `plan` on `cfg` (vocab_size resolved) at `context_length` (default the model's)."""
    import torch

    from gaudi3_scale.models import build_model, flops_per_token

    with torch.device("meta"):
        model = build_model(cfg)
    converted = fast = 0
    fast_flops = 0.0
    for _, module in convertible_linears(model, head=plan.head):
        out_features, in_features = module.weight.shape
        if plan.skip_small_linears and not fast_in_fp8(plan.recipe, out_features, in_features):
            continue
        converted += 1
        if fast_in_fp8(plan.recipe, out_features, in_features):
            fast += 1
            fast_flops += 6 * out_features * in_features
    share = fast_flops / flops_per_token(cfg, context_length or cfg.context_length)
    return Fp8Gain(share=share, gain=1 / (1 - share * FP8_TIME_SAVED), converted=converted, fast=fast)
