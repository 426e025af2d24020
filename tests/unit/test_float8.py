"""FP8 training (`train.precision fp8`): refused with one line where it cannot run, kept out of the tuner's axis
there, and torchao's float8 linears swapped into our Transformer with the state-dict keys of a bf16 run, by the
recipe of `train.fp8_recipe` and with the head when `train.fp8_head` says so.

torch 2.13 has a CPU kernel for `torch._scaled_mm`, so torchao's float8 forward and backward run here for real
(not emulated): the training test below compares them with fp32."""

from __future__ import annotations

import copy
import dataclasses
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.device.float8 import FLOAT8_RECIPES, Float8Plan, apply_float8, check_float8_supported
from gaudi3_scale.device.select import plan_device
from gaudi3_scale.models import ModelConfig, Transformer, build_model
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.tune.space import Candidate, build_space, supported_precisions
from gaudi3_scale.tune.tuner import winner_config

VOCAB = 96

# 2 blocks each. GPT-2: MLP width 72 is not a multiple of 16, so w1/w2 stay; the head is tied to the embedding.
GPT2 = ModelConfig(
    arch="gpt2", num_layers=2, num_heads=4, dim=64, ffn_dim=72, vocab_size=VOCAB, context_length=32
)
# Llama: 2 of 16 heads for keys/values at head_dim 4 makes wk/wv 8 wide, so they stay; the head is untied.
LLAMA = ModelConfig(
    arch="llama", num_layers=2, num_heads=16, num_kv_heads=2, dim=64, ffn_dim=128, vocab_size=VOCAB,
    context_length=32, bias=False, tie_embeddings=False,
)  # fmt: skip
EXPECTED = {
    "gpt2": {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")},
    "llama": {f"layers.{i}.{w}" for i in range(2) for w in ("attention.wq", "attention.wo", "feed_forward.w1",
                                                            "feed_forward.w2", "feed_forward.w3")},
}  # fmt: skip
no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal where no CUDA GPU is present"
)


def _float8_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


def _torchao() -> None:
    pytest.importorskip("torchao.float8", reason="needs the `fp8` extra (in `test`)")


def test_cpu_refuses_fp8_with_one_line_naming_the_field_and_the_allowed_values() -> None:
    with pytest.raises(ConfigError) as info:
        plan_device("cpu", "fp8", threads=1)
    message = str(info.value)
    assert info.value.field == "train.precision" and "\n" not in message
    assert message.startswith(
        "train.precision: fp8 training needs an NVIDIA GPU with compute capability >= 8.9"
    )
    assert message.endswith("allowed on cpu: 32-true, bf16-mixed, bf16-true")


def test_gaudi_refuses_fp8_as_not_validated_whether_or_not_a_gaudi_is_present() -> None:
    for refuse in (lambda: check_float8_supported("hpu"), lambda: plan_device("hpu", "fp8", threads=1)):
        with pytest.raises(
            ConfigError, match=r"^train\.precision: .*not yet validated on Gaudi.*use bf16-mixed$"
        ):
            refuse()


@no_cuda
def test_auto_device_without_a_gpu_refuses_fp8_and_plans_stay_bf16_free_of_float8() -> None:
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9"):
        plan_device("auto", "fp8", threads=1)
    assert plan_device("cpu", "32-true", threads=1).float8 is False


def test_tuner_axis_keeps_fp8_out_on_cpu() -> None:
    cpu = supported_precisions("cpu")
    assert "fp8" not in cpu and cpu[0] == "32-true" and set(cpu) <= {"32-true", "bf16-mixed"}
    base = build_run_config(None, [("train.global_batch_size", "4"), ("train.device", "cpu")])
    assert "fp8" not in build_space(base, world_size=1).precisions
    with pytest.raises(
        UserInputError, match=r"--precisions: fp8 not supported on cpu here; allowed: 32-true"
    ):
        build_space(base, world_size=1, precisions=("fp8",))


@no_cuda
def test_cli_train_fp8_on_cpu_exits_2_with_one_line(
    gaudi3_cli: Callable[..., tuple[int, str, str]], tmp_path: Path
) -> None:
    # With an fp8 option too: the line that helps is that fp8 cannot run here, not one about the option.
    code, _, err = gaudi3_cli(
        "train", "--train.precision", "fp8", "--train.fp8_recipe", "rowwise", "--train.max_steps", "1",
        "--train.threads", "1", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert code == 2, err
    assert (
        err.startswith("gaudi3: error: train.precision: fp8 training needs an NVIDIA GPU")
        and err.count("\n") == 1
    )
    assert not (tmp_path / "run").exists()  # refused before any data work or output


def _pretend_gpu(monkeypatch: pytest.MonkeyPatch, name: str, capability: tuple[int, int]) -> None:
    """No GPU here: stand in the few torch.cuda queries plan_device and the checks make, for one named GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_hopper_plans_fp8_as_bf16_mixed_with_float8_and_mfu_against_the_bf16_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _torchao()
    _pretend_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    plan = plan_device("cuda", "fp8", threads=1)
    assert (plan.accelerator, plan.precision, plan.float8) == ("cuda", "bf16-mixed", True)
    assert plan.peak_flops == pytest.approx(989.4e12)  # BF16 dense, not the FP8 1978.9
    assert (
        plan.peak_source.startswith("BF16 dense peak, used for fp8 runs too") and "1978.9" in plan.peak_source
    )
    assert plan_device("cuda", "bf16-mixed", threads=1).float8 is False
    assert supported_precisions("cuda") == ("bf16-mixed", "fp8")


def test_a_gpu_below_compute_capability_8_9_is_named_in_the_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    with pytest.raises(ConfigError) as info:
        plan_device("cuda", "fp8", threads=1)
    assert str(info.value) == (
        "train.precision: fp8 training needs an NVIDIA GPU with compute capability >= 8.9 (Ada/Hopper or newer); "
        "NVIDIA A100-SXM4-80GB has 8.0; allowed here: bf16-mixed, bf16-true, 32-true"
    )
    assert supported_precisions("cuda") == ("bf16-mixed",)


def test_missing_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an environment without torchao imports
    _pretend_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    assert supported_precisions("cuda") == ("bf16-mixed",)
    with pytest.raises(ConfigError, match=r"^train\.precision: fp8 training needs torchao: pip install"):
        check_float8_supported("cuda")
    with pytest.raises(
        ConfigError, match=r"^train\.precision: .*needs torchao: pip install 'gaudi3-scale\[fp8\]'$"
    ):
        apply_float8(build_model(GPT2, seed=0))


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_apply_float8_swaps_exactly_the_eligible_linears_and_keeps_the_state_dict(cfg: ModelConfig) -> None:
    _torchao()
    model = build_model(cfg, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = {name: id(p) for name, p in model.named_parameters()}
    assert apply_float8(model) == len(EXPECTED[cfg.arch])
    assert _float8_names(model) == EXPECTED[cfg.arch]
    assert type(model.output) is nn.Linear
    # Same keys, bitwise the same values, the very same Parameters (optimizer groups and tying survive).
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert {name: id(p) for name, p in model.named_parameters()} == params_before
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    # Idempotent: nothing left to swap, nothing swapped twice.
    assert apply_float8(model) == 0 and _float8_names(model) == EXPECTED[cfg.arch]
    # A checkpoint moves both ways between fp8 and bf16/fp32 runs (strict: no missing or extra keys).
    plain = build_model(cfg, seed=1)
    plain.load_state_dict(model.state_dict(), strict=True)
    assert all(torch.equal(plain.state_dict()[k], before[k]) for k in before)
    model.load_state_dict(build_model(cfg, seed=2).state_dict(), strict=True)


def test_apply_float8_on_meta_then_init_matches_a_direct_build() -> None:
    _torchao()
    with torch.device("meta"):
        model = Transformer(LLAMA)
    assert apply_float8(model, recipe="rowwise") == len(EXPECTED["llama"])
    model.to_empty(device="cpu")
    model.init_weights(0)
    direct = build_model(LLAMA, seed=0).state_dict()
    assert all(torch.equal(v, direct[k]) for k, v in model.state_dict().items())


def test_apply_float8_refuses_an_unknown_recipe() -> None:
    with pytest.raises(
        ValueError, match=r"float8 recipe 'delayed' is not one of tensorwise, rowwise, rowwise_with_gw_hp$"
    ):
        apply_float8(build_model(GPT2, seed=0), recipe="delayed")


@pytest.mark.parametrize("head", [False, True], ids=["head-bf16", "head-fp8"])
@pytest.mark.parametrize("recipe", FLOAT8_RECIPES)
def test_each_recipe_reaches_torchao_and_the_head_is_swapped_only_when_asked(recipe: str, head: bool) -> None:
    _torchao()
    from torchao.float8 import Float8LinearConfig

    for cfg in (GPT2, LLAMA):
        model = build_model(cfg, seed=0)
        expected = EXPECTED[cfg.arch] | ({"output"} if head else set())
        assert apply_float8(model, recipe=recipe, head=head) == len(expected)
        assert _float8_names(model) == expected
        configs = {m.config for m in model.modules() if type(m).__name__ == "Float8Linear"}
        assert configs == {Float8LinearConfig.from_recipe_name(recipe)}
        if cfg.tie_embeddings:  # GPT-2's head, swapped or not, still is the token embedding
            assert model.output.weight is model.tok_embeddings.weight


# (in_features, out_features) of linears on either side of torchao's thresholds (torchao 0.18, from its H100 GEMM
# tables): tensorwise keeps in bf16 what has in <= 4096 and out <= 1024; rowwise what has out <= 2048, in <= 1024,
# or out <= 4096 and in <= 2048.
SIZES = [(2048, 512), (4096, 1024), (4112, 1024), (2048, 1040), (1024, 8192), (1040, 8192), (2048, 4096),
         (2064, 4096), (2048, 4112), (8192, 2048), (8192, 2064), (2048, 1000)]  # fmt: skip
FAST_IN_FP8 = {
    "tensorwise": {(4112, 1024), (2048, 1040), (1024, 8192), (1040, 8192), (2048, 4096), (2064, 4096),
                   (2048, 4112), (8192, 2048), (8192, 2064)},
    "rowwise": {(1040, 8192), (2064, 4096), (2048, 4112), (8192, 2064)},
}  # fmt: skip


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_skip_small_linears_keeps_in_bf16_what_torchaos_thresholds_find_slower(recipe: str) -> None:
    _torchao()
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(k, n, bias=False) for k, n in SIZES))
    assert apply_float8(model, recipe=recipe, skip_small_linears=True) == len(FAST_IN_FP8[recipe])
    assert {SIZES[int(name)] for name in _float8_names(model)} == FAST_IN_FP8[recipe]
    with torch.device("meta"):
        everything = nn.Sequential(*(nn.Linear(k, n, bias=False) for k, n in SIZES))
    assert (
        apply_float8(everything, recipe=recipe) == len(SIZES) - 1
    )  # all but 2048 -> 1000 (not a multiple of 16)


def test_skip_small_linears_is_refused_for_the_recipe_without_thresholds() -> None:
    with pytest.raises(ValueError, match=r"no size thresholds for the float8 recipe 'rowwise_with_gw_hp'$"):
        apply_float8(build_model(LLAMA, seed=0), recipe="rowwise_with_gw_hp", skip_small_linears=True)
    with pytest.raises(
        ConfigError,
        match=r"^train\.fp8_skip_small_linears: true needs a recipe .*\(tensorwise, "
        r"rowwise\), not train\.fp8_recipe rowwise_with_gw_hp$",
    ):
        build_run_config(None, [("train.precision", "fp8"), ("train.fp8_recipe", "rowwise_with_gw_hp"),
                                ("train.fp8_skip_small_linears", "true")])  # fmt: skip


def test_loading_the_run_config_does_not_import_torch() -> None:
    """`train.fp8_recipe` is typed by device.float8, which therefore imports torch only inside its functions."""
    code = "import sys, gaudi3_scale.train.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tuner_candidates_of_other_precisions_hold_the_fp8_options_at_their_defaults() -> None:
    """The config's fp8 options go to its fp8 candidates; a bf16 trial or winner would otherwise be refused."""
    base = build_run_config(
        None, [("train.precision", "fp8"), ("train.fp8_recipe", "rowwise"), ("train.fp8_head", "true"),
               ("train.fp8_skip_small_linears", "true")],
    )  # fmt: skip
    bf16 = Candidate(strategy="auto", precision="bf16-mixed", global_batch_size=12, micro_batch_size=12,
                     activation_checkpointing=False, compile=False, threads=None)  # fmt: skip
    fp8 = dataclasses.replace(bf16, precision="fp8")
    for candidate, want in ((bf16, ("tensorwise", False, False)), (fp8, ("rowwise", True, True))):
        pairs = [(k, v) for k, v in (o[2:].split("=", 1) for o in candidate.overrides())]
        trial = build_run_config(None, pairs, base=to_dict(base)).train
        winner = winner_config(base, candidate, 1, "none")[0].train
        chosen = [(c.fp8_recipe, c.fp8_head, c.fp8_skip_small_linears) for c in (trial, winner)]
        assert chosen == [want, want]


def _train(model: nn.Module, steps: int) -> list[float]:
    """AdamW on one fixed batch (memorization): the loss after each step."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4, 33), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fp8_forward_and_backward_train_like_fp32_on_cpu() -> None:
    _torchao()
    reference = build_model(LLAMA, seed=0)
    fp8 = copy.deepcopy(reference)
    apply_float8(fp8)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # The float8 path really ran: rounding to FP8 changes the logits a little, never a lot.
        diff = (fp8(tokens) - reference(tokens)).abs().max().item()
    assert 0 < diff < 0.05
    ref_losses, fp8_losses = _train(reference, 30), _train(fp8, 30)
    assert ref_losses[-1] < 0.5 * math.log(VOCAB)  # the fixed batch is being memorized
    assert abs(fp8_losses[0] - ref_losses[0]) / ref_losses[0] < 0.01
    assert abs(fp8_losses[-1] - ref_losses[-1]) / ref_losses[-1] < 0.05


def test_the_fp8_options_reach_the_training_module_through_the_plan_before_compile() -> None:
    """`train.fp8_recipe` and `train.fp8_head` become the plan's `Float8Plan` when the device plan says fp8 (as the
    trainer asks for it); the module swaps the linears in configure_model with that recipe, the head included, and
    the compiled loss region then wraps the swapped model."""
    _torchao()
    from torchao.float8 import Float8LinearConfig

    from gaudi3_scale.train.module import LanguageModel
    from gaudi3_scale.train.optim_config import OptimConfig

    cfg = build_run_config(
        None, [("train.precision", "fp8"), ("train.fp8_recipe", "rowwise_with_gw_hp"), ("train.fp8_head", "true"),
               ("train.compile", "true")],
    )  # fmt: skip
    skipping = build_run_config(None, [("train.precision", "fp8"), ("train.fp8_skip_small_linears", "true")])
    assert skipping.parallel_plan(float8=True).float8 == Float8Plan(
        recipe="tensorwise", head=False, skip_small_linears=True
    )
    assert cfg.parallel_plan().float8 is None  # the device plan decides whether: here it did not say fp8
    plan = cfg.parallel_plan(float8=True)
    assert plan.float8 == Float8Plan(recipe="rowwise_with_gw_hp", head=True, skip_small_linears=False)
    assert plan.compile
    module = LanguageModel(LLAMA, OptimConfig(), max_steps=1, parallel=plan)
    module.configure_model()
    assert module.model is not None and _float8_names(module.model) == EXPECTED["llama"] | {"output"}
    assert module.model.output.config == Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    plain = LanguageModel(LLAMA, OptimConfig(), max_steps=1)
    plain.configure_model()
    assert plain.model is not None and not _float8_names(plain.model)
