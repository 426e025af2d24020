"""benchmarks/bench_serve_kv.py keeps working on CPU in its GPU form (models, client counts, budget, verdict), so a
GPU session only has to run it with `--device cuda`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve_kv.py"
ENV = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
MODES = ("dynamic", "static", "off")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=ENV,
                          timeout=300)  # fmt: skip


def test_small_dry_run_measures_every_cell_and_writes_a_verdict(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    done = _run("--small", "--device", "cpu", "--model", "llama-tiny", "--clients", "2", "--budget-s", "120",
                "--git-commit", "0123abc", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "serve_kv_cpu" and report["git_commit"] == "0123abc"
    assert report["models"]["llama-tiny"]["context_length"] == 512 and list(report["models"]) == [
        "llama-tiny"
    ]
    assert report["skipped"] == [] and report["machine"]["cpu_count"] >= 1
    cells = {(c["clients"], c["kv_cache"]): c for c in report["cells"]}
    assert set(cells) == {(2, m) for m in MODES}
    for (clients, mode), cell in cells.items():
        assert cell["errors"] == 0 and cell["requests"] == clients and cell["generated_tokens_per_s"] > 0, (
            cell
        )
        ratio = report["tokens_per_s_over_recompute"]["llama-tiny"][str(clients)][mode]
        assert ratio == pytest.approx(
            cell["generated_tokens_per_s"] / cells[clients, "off"]["generated_tokens_per_s"]
        )
    # The cache skips re-reading 384+ positions per token: well ahead of recomputing even for a 2-layer model.
    assert cells[2, "dynamic"]["generated_tokens_per_s"] > 1.5 * cells[2, "off"]["generated_tokens_per_s"]
    assert report["verdict"].startswith("llama-tiny: static/dynamic x")
    assert "dynamic/off x" in report["verdict"] and "3 cells ran, 0 skipped, 0 errors" in report["verdict"]
    assert f"verdict: {report['verdict']}" in done.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "kv.partial.json").exists()  # a finished run replaced --out with its partial file

    bad = _run("--model", "llama-tiny,nope", "--out", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "--model: unknown nope; valid: gpt12-ctx512, llama3.2-1b" in bad.stderr
    assert not (tmp_path / "bad.json").exists()


def test_an_interrupted_run_leaves_the_stored_results_as_they_were(tmp_path: Path) -> None:
    """`timeout` stops the bench (SIGTERM) after its first cell: --out keeps the stored run, the cells that finished
    are in the partial file beside it."""
    out = tmp_path / "kv.json"
    stored = json.dumps({"cells": [{"model": "gpt12-ctx512", "kv_cache": "off"}], "verdict": "stored"})
    out.write_text(stored)
    partial = tmp_path / "kv.partial.json"
    bench = subprocess.Popen([sys.executable, str(SCRIPT), "--small", "--device", "cpu", "--model", "llama-tiny",
                              "--clients", "2", "--out", str(out)], env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not partial.exists() and bench.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) in (0, 128 + signal.SIGTERM)
    assert out.read_text() == stored
    assert json.loads(partial.read_text())["benchmark"] == "serve_kv_cpu"


def _load_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_serve_kv", SCRIPT)
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_budget_skips_cells_estimated_to_end_past_it() -> None:
    bench = _load_module()
    report: dict = {"cells": [], "skipped": []}
    for mode, wall_s in (("dynamic", 2.0), ("static", 3.0), ("off", 10.0)):
        report["cells"].append({"model": "m", "kv_cache": mode, "clients": 1, "wall_s": wall_s})
    args = argparse.Namespace(budget_s=60.0)
    # At 4 clients: dynamic 8 s (ends at 28), static 12 s (ends at 40), off 40 s would end at 80: skipped.
    assert bench._modes_to_run(report, "m", 4, args, 20.0) == ("dynamic", "static")
    assert [(s["kv_cache"], s["clients"]) for s in report["skipped"]] == [("off", 4)]
    assert report["skipped"][0]["reason"] == "estimated to end at 80.0 s, past the 60 s budget"
    # A mode skipped at fewer clients stays skipped; past the budget nothing starts; a new model's first cells run.
    assert bench._modes_to_run(report, "m", 8, args, 20.0) == ("dynamic", "static")
    assert report["skipped"][-1]["reason"] == "skipped at fewer clients"
    assert bench._modes_to_run(report, "m", 8, args, 61.0) == ()
    assert bench._modes_to_run(report, "other", 1, args, 59.0) == MODES
    assert bench._modes_to_run(report, "m", 64, argparse.Namespace(budget_s=None), 1e6) == MODES


def test_the_large_models_fast_random_export_serves_in_float32(tmp_path: Path) -> None:
    """Llama 3.2 1B's export path (plain draws, bf16 on disk), on llama-tiny: it loads as serve loads it."""
    import torch
    from safetensors.torch import load_file

    from gaudi3_scale.serve.loading import load_served_model, resolve_source

    bench = _load_module()

    cfg = bench._model_config("llama-tiny")
    export = bench._build_export(tmp_path, cfg, bench._random_model(cfg, "cpu"))
    stored = load_file(str(export / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert 0.015 < stored["layers.0.attention.wq.weight"].float().std().item() < 0.025
    served = load_served_model(resolve_source(export))
    assert {p.dtype for p in served.model.parameters()} == {torch.float32}
    assert served.config.context_length == 512 and served.config.vocab_size == 256
