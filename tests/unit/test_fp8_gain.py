"""The modelled fp8 gain (`tune.fp8_gain`): its one measured constant, torchao's size tables, and the tuner leaving
fp8 out where the model says it cannot pay."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from torch import nn

from gaudi3_scale.device.float8 import Float8Plan
from gaudi3_scale.models import get_model_config
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.tune.fp8_gain import FP8_TIME_SAVED, MIN_FP8_GAIN, fast_in_fp8, fp8_gain
from gaudi3_scale.tune.space import fp8_if_it_pays

H200 = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_shapes_cuda_h200.json"
HEAD = Float8Plan(recipe="tensorwise", head=True, skip_small_linears=False)


def test_time_saved_is_the_measured_shape() -> None:
    """FP8_TIME_SAVED comes from the stored H200 pair: Llama 3.2 1B at 8 × 2048, tensorwise, head in fp8."""
    result = json.loads(H200.read_text())
    ratio = result["fp8"]["llama3.2-1b-fp8-head"]["fp8_over_bf16_tokens_per_s"]
    cell = result["shapes"]["llama3.2-1b-fp8-head"]["cell"]
    cfg = replace(get_model_config(cell["model"]), vocab_size=cell["vocab_size"],
                  context_length=cell["context_length"]).resolve_padding("cuda")  # fmt: skip
    share = fp8_gain(cfg, HEAD).share
    assert pytest.approx((1 - 1 / ratio) / share, abs=5e-4) == FP8_TIME_SAVED
    assert fp8_gain(cfg, HEAD).gain == pytest.approx(ratio, rel=1e-3)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fast_in_fp8_is_torchaos_table(recipe: str) -> None:
    float8 = pytest.importorskip("torchao.float8")
    torchaos = float8._auto_filter_for_recipe(recipe, filter_fqns=[])
    sizes = [512, 1024, 1040, 2048, 2064, 3072, 4096, 4112, 8192]
    for out in sizes:
        for inp in sizes:
            linear = nn.Linear(inp, out, bias=False, device="meta")
            assert fast_in_fp8(recipe, out, inp) == torchaos(linear, "layers.0.w"), (recipe, out, inp)


def test_llama_1b_parts() -> None:
    cfg = replace(get_model_config("llama3.2-1b"), vocab_size=128256, context_length=2048).resolve_padding(
        "cuda"
    )
    body = fp8_gain(cfg, Float8Plan(recipe="tensorwise", head=False, skip_small_linears=False))
    head = fp8_gain(cfg, HEAD)
    # 16 blocks × 7 linears (wq, wk, wv, wo, w1, w2, w3); the 2048 → 512 wk and wv are too small for tensorwise
    assert (body.converted, body.fast) == (112, 80) and (head.converted, head.fast) == (113, 81)
    assert body.gain < head.gain < 1 / (1 - FP8_TIME_SAVED)
    skip = fp8_gain(cfg, Float8Plan(recipe="tensorwise", head=False, skip_small_linears=True))
    assert (skip.converted, skip.fast, skip.gain) == (80, 80, body.gain)


def _config(model: str) -> object:
    return build_run_config(None, [("model.name", model), ("model.vocab_size", "50257" if "gpt2" in model else
                                                                        "128256")])  # fmt: skip


def test_the_tuner_leaves_fp8_out_where_it_cannot_pay() -> None:
    gpt2 = _config("gpt2-124m")
    kept, notes = fp8_if_it_pays(gpt2, ("bf16-mixed", "fp8"))  # type: ignore[arg-type]
    assert kept == ("bf16-mixed",)
    (note,) = notes
    assert (
        note.startswith("fp8 left out: tensorwise is modelled at ×1.0") and f"below ×{MIN_FP8_GAIN}" in note
    )
    llama = _config("llama3.2-1b")
    kept, notes = fp8_if_it_pays(llama, ("bf16-mixed", "fp8"))  # type: ignore[arg-type]
    assert kept == ("bf16-mixed", "fp8") and "modelled at ×1.1" in notes[0]
    assert fp8_if_it_pays(gpt2, ("bf16-mixed",)) == (("bf16-mixed",), ())  # type: ignore[arg-type]
