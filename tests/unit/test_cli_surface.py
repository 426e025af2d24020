"""The CLI surface is a contract: verbs and their options change only on purpose (update this test then)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from gaudi3_scale.cli.main import VERBS, cli

BIN = Path(sys.executable).parent  # console scripts live beside the interpreter of the venv running the tests

EXPECTED = {
    "benchmark": [],
    "ckpt": [],
    "cost": [],
    "dashboard": ["--host", "--port", "--runs", "--token"],
    "deploy": [],
    "doctor": ["--check", "--config", "--json", "--out", "--rdzv-endpoint", "--skip"],
    "health": [],
    "generate": ["--max-new-tokens", "--prompt", "--seed", "--temperature", "--tokenizer", "--top-k"],
    "models": [],
    "plan": ["--compare", "--config", "--machine", "--nodes", "--out", "--probe", "--refresh-peak"],
    "prepare": ["--force", "--out", "--seed", "--shard-mb", "--text-field", "--tokenizer", "--val-fraction", "--vocab-size",
                "--workers"],
    "serve": ["--client-timeout-s", "--host", "--kv-cache", "--max-batch-size", "--max-prompt-tokens", "--max-queue",
              "--max-tokens-limit", "--name", "--port", "--tokenizer", "--tracking-uri"],
    "smoke": ["--keep", "--out", "--steps"],
    "repro": ["--config", "--keep", "--mode", "--out", "--steps",
              "--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts"],
    "train": ["--config", "--dry-run", "--list-fields", "--no-progress", "--out", "--print-config", "--profile", "--progress",
              "--resume", "--sample-tokens", "--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts"],
    "tune": ["--accelerator", "--activation-checkpointing", "--compile", "--config", "--estimate-only",
             "--global-batch", "--lr-rule", "--measure-steps", "--memory-budget", "--no-estimate-pruning", "--out", "--pipeline",
             "--precisions", "--strategies", "--target-utilization", "--threads", "--time-budget-min", "--trial-timeout-s",
             "--warmup-steps", "--world-size"],
}  # fmt: skip


def _options(command: click.Command) -> list[str]:
    names = []
    for param in command.params:
        if isinstance(param, click.Option):
            names += [o for o in param.opts + param.secondary_opts if o.startswith("--")]
    return sorted(n for n in names if n != "--help")


def test_verbs_and_options_are_pinned() -> None:
    assert sorted(VERBS) == sorted(EXPECTED)
    for name, options in EXPECTED.items():
        assert _options(cli.commands[name]) == sorted(options), name


def test_ckpt_subcommands_are_pinned() -> None:
    group = cli.commands["ckpt"]
    assert isinstance(group, click.Group)
    expected = {
        "list": ["--verify"],
        "verify": [],
        "diff": [],
        "export": [
            "--experiment",
            "--force",
            "--format",
            "--out",
            "--register",
            "--tokenizer",
            "--tracking-uri",
        ],
    }
    assert sorted(group.commands) == sorted(expected)
    for name, options in expected.items():
        assert _options(group.commands[name]) == options, name


def test_benchmark_subcommands_are_pinned() -> None:
    group = cli.commands["benchmark"]
    assert isinstance(group, click.Group)
    expected = {
        "run": ["--cell-timeout-s", "--dry-run", "--matrix", "--out", "--retry-failed"],
        "collect": ["--out"],
        "report": ["--label", "--out", "--price", "--title"],
        "matrices": [],
    }
    assert sorted(group.commands) == sorted(expected)
    for name, options in expected.items():
        assert _options(group.commands[name]) == options, name


def test_console_scripts_and_module_entry_points() -> None:
    out = subprocess.run(
        [str(BIN / "gaudi3-train"), "--print-config", "--model.num_layers", "3"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "num_layers: 3" in out.stdout and "global_batch_size: 12" in out.stdout
    same = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.train", "--print-config", "--model.num_layers", "3"],
        capture_output=True,
        text=True,
    )
    assert same.stdout == out.stdout
    fields = subprocess.run(
        [str(BIN / "gaudi3"), "train", "--list-fields"], capture_output=True, text=True
    ).stdout
    assert "--model.num_layers" in fields and "--train.global_batch_size" in fields and "--optim.lr" in fields
    assert "--model.init_from" in fields  # pretrained weights (models.pretrained)
    assert "--benchmark.result" in fields
    matrices = subprocess.run([str(BIN / "gaudi3-benchmark"), "matrices"], capture_output=True, text=True)
    assert matrices.returncode == 0 and matrices.stdout.startswith("cpu-small: 4 cells"), matrices.stderr
