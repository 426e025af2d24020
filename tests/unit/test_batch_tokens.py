"""`train.global_batch_tokens`: a global batch stated in tokens, resolved to sequences of `model.context_length`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gaudi3_scale.cli.main import main
from gaudi3_scale.config import ConfigError
from gaudi3_scale.config.core import from_dict, parse_overrides, save_yaml, to_dict
from gaudi3_scale.train.config import RunConfig, build_run_config


def _build(*args: str) -> RunConfig:
    return build_run_config(None, parse_overrides(list(args)))


def test_tokens_resolve_to_sequences_of_the_context_length() -> None:
    cfg = _build("--train.global_batch_tokens", "2048")  # shakespeare-char: context_length 64
    assert (cfg.train.global_batch_tokens, cfg.train.global_batch_size) == (2048, 32)
    big = _build("--model.name", "gpt2-124m", "--train.global_batch_tokens", "524288")  # context_length 1024
    assert big.train.global_batch_size == 512
    assert _build().train.global_batch_tokens is None  # unset: the batch stays in sequences (default 12)


def test_tokens_follow_a_context_length_override() -> None:
    cfg = _build("--train.global_batch_tokens", "2048", "--model.context_length", "128")
    assert cfg.train.global_batch_size == 16


def test_tokens_not_divisible_by_the_context_length() -> None:
    with pytest.raises(ConfigError) as info:
        _build("--train.global_batch_tokens", "2000")
    assert str(info.value) == (
        "train.global_batch_tokens: 2000 is not divisible by model.context_length (64); "
        "nearest valid: 1984 or 2048"
    )
    with pytest.raises(
        ConfigError, match=r"^train.global_batch_tokens: 30 is not .*\(64\); nearest valid: 64$"
    ):
        _build("--train.global_batch_tokens", "30")  # nothing valid below
    with pytest.raises(ConfigError, match=r"^train.global_batch_tokens: must be > 0, got 0$"):
        _build("--train.global_batch_tokens", "0")


def test_both_set_must_agree() -> None:
    with pytest.raises(ConfigError) as info:
        _build("--train.global_batch_tokens", "2048", "--train.global_batch_size", "12")
    assert str(info.value) == (
        "train.global_batch_tokens: 2048 tokens = 32 sequences of model.context_length 64, "
        "but train.global_batch_size is 12; set only one of them"
    )
    same = _build("--train.global_batch_tokens", "2048", "--train.global_batch_size", "32")
    assert same == _build("--train.global_batch_tokens", "2048")


def test_saved_resolved_config_loads_again(tmp_path: Path) -> None:
    cfg = _build("--train.global_batch_tokens", "4096", "--train.micro_batch_size", "16")
    save_yaml(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]
    assert (saved["global_batch_tokens"], saved["global_batch_size"]) == (4096, 64)
    assert build_run_config(tmp_path / "config.yaml") == cfg
    assert from_dict(RunConfig, to_dict(cfg)) == cfg


def test_accumulation_is_derived_from_the_resolved_batch_on_two_ranks() -> None:
    cfg = _build(
        "--train.global_batch_tokens",
        "4096",
        "--train.micro_batch_size",
        "8",
        "--parallel.nproc_per_node",
        "2",
    )
    assert cfg.parallel.world_size == 2 and cfg.train.global_batch_size == 64
    assert cfg.batch_plan().accumulation == 4  # 64 = 8 × 4 × 2
    whole = _build("--train.global_batch_tokens", "4096", "--parallel.nproc_per_node", "2")
    assert whole.batch_plan(2).micro_batch_size == 32 and whole.batch_plan(2).accumulation == 1
    with pytest.raises(
        ConfigError, match=r"^train.global_batch_size: 6 is not divisible by .* \(2\) × ranks \(2\)"
    ):
        _build(
            "--train.global_batch_tokens",
            "384",
            "--train.micro_batch_size",
            "2",
            "--parallel.nproc_per_node",
            "2",
        )


def _train_print_config(value: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(["train", "--print-config", f"--train.global_batch_tokens={value}"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_prints_the_resolved_batch_or_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _train_print_config("2000", capsys)
    assert code == 2 and out == ""
    assert err == (
        "gaudi3: error: train.global_batch_tokens: 2000 is not divisible by model.context_length (64); "
        "nearest valid: 1984 or 2048\n"
    )
    code, out, err = _train_print_config("2048", capsys)
    assert (code, err) == (0, "")
    train = yaml.safe_load(out)["train"]
    assert (train["global_batch_tokens"], train["global_batch_size"]) == (2048, 32)
