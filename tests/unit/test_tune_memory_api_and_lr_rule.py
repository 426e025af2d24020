"""`AdaptiveBatchFinder`'s precision argument (default: every precision the hardware supports; an unsupported one is
refused naming `precision=`), and the `sqrt` learning-rate rule said as what it does (lr × √k, betas and eps kept)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.tune.api import AdaptiveBatchFinder
from gaudi3_scale.tune.lr import LR_RULES, rescale_schedule
from gaudi3_scale.tune.space import supported_precisions

DOCS = Path(__file__).parents[2] / "docs"


def test_the_default_precision_is_every_one_the_hardware_supports(tmp_path: Path) -> None:
    finder = AdaptiveBatchFinder("shakespeare-char", global_batch_size=4, out_dir=tmp_path / "tune")
    assert finder.space.device == "cpu"
    # before: ("bf16-mixed",) only, refused outright on a CPU or GPU without bf16
    assert finder.space.precisions == supported_precisions("cpu")
    assert "32-true" in finder.space.precisions


def test_an_unsupported_precision_is_refused_naming_the_argument(tmp_path: Path) -> None:
    allowed = ", ".join(map(repr, supported_precisions("cpu")))
    with pytest.raises(UserInputError) as refused:
        AdaptiveBatchFinder("shakespeare-char", precision="16-mixed", out_dir=tmp_path / "tune")
    assert str(refused.value) == (
        f"precision='16-mixed' is not supported on cpu here; allowed: {allowed}, or None for every one of them"
    )
    assert not (tmp_path / "tune").exists()


def test_the_sqrt_rule_scales_only_the_learning_rate_and_says_so() -> None:
    schedule = rescale_schedule(
        lr=1e-3, min_lr=1e-4, warmup_steps=100, max_steps=1000, from_batch=8, to_batch=32, rule="sqrt"
    )
    assert (schedule.lr, schedule.min_lr) == pytest.approx((2e-3, 2e-4))
    assert not {"beta1", "beta2", "betas", "eps"} & set(vars(schedule))  # nothing else of AdamW changes
    said = LR_RULES["sqrt"]
    assert said.startswith("lr × √k, betas and eps kept (the learning-rate part of Malladi et al. 2022")
    doc = " ".join((DOCS / "concepts" / "tuner.md").read_text().split())
    assert (
        "lr × √k with AdamW's betas and eps unchanged: the learning-rate part of Malladi et al. 2022" in doc
    )
