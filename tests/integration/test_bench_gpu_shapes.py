"""benchmarks/bench_gpu_shapes.py keeps working on CPU (its tiny shape set), so a GPU session only has to run it;
`--rescore` holds the forecasts of the code as it is against stored measurements."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu_shapes.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_shapes_measured_and_forecast_then_rescored(tmp_path: Path) -> None:
    out = tmp_path / "shapes.json"
    done = _run(
        "--small", "--shapes", "tiny-llama-ckpt,tiny-bert", "--measured-steps", "4", "--out", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert list(result["shapes"]) == ["tiny-llama-ckpt", "tiny-bert"]
    for row in result["shapes"].values():
        run, forecast = row["run"], row["forecast"]
        assert run["status"] == "ok" and run["measured_steps"] == 4, run
        assert run["peak_memory_bytes"] > 0 and run["step_time_s"] > 0 and run["process_s"] >= run["wall_s"]
        assert forecast["memory_bytes"] == sum(
            v for k, v in forecast["memory_parts_bytes"].items() if k != "peak_phase"
        )
        assert row["memory_error"] == pytest.approx(
            (forecast["memory_bytes"] - run["peak_memory_bytes"]) / run["peak_memory_bytes"]
        )
        tokens = row["cell"]["micro_batch_size"] * row["cell"]["context_length"]
        assert forecast["step_time_s"] == pytest.approx(
            forecast["flops_per_token"] * tokens / (result["peak_flops"] * 0.40)
        )
    # BERT's MLM adds its special tokens after the data's 512 ids: the model's vocabulary is 516
    assert result["shapes"]["tiny-bert"]["cell"]["data_vocab_size"] == 512
    assert result["fp8"] == {} and result["verdict"].startswith("2/2 shapes ran; memory estimate")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"

    # A stale forecast in a stored file is replaced by the code's; measurements and machine stay as measured.
    stored = json.loads(out.read_text())
    stored["shapes"]["tiny-bert"]["forecast"]["memory_bytes"] = 1
    stored["shapes"]["tiny-bert"]["memory_error"] = 123.0
    older = tmp_path / "older.json"
    older.write_text(json.dumps(stored))
    merged = tmp_path / "merged.json"
    done = _run("--rescore", str(older), "--out", str(merged))
    assert done.returncode == 0, done.stdout + done.stderr
    again = json.loads(merged.read_text())
    bert = again["shapes"]["tiny-bert"]
    assert bert["forecast"]["memory_bytes"] == result["shapes"]["tiny-bert"]["forecast"]["memory_bytes"]
    assert bert["memory_error"] == pytest.approx(result["shapes"]["tiny-bert"]["memory_error"])
    assert bert["run"] == result["shapes"]["tiny-bert"]["run"] and bert["measured_in"] == "older.json"
    assert again["machine"] == result["machine"] and again["forecast_by"]["date"]

    # Each row keeps what it was measured with: this run's machine, peak and invocation id.
    for row in result["shapes"].values():
        assert row["measured_with"]["machine"] == result["machine"]
        assert row["measured_with"]["peak_flops"] == result["peak_flops"] and row["measured_with"]["run_id"]
    # A shape skipped for the budget (or failed, or timed out) never replaces the stored row that ran.
    done = _run("--small", "--shapes", "tiny-bert", "--budget-s", "10", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    kept = json.loads(out.read_text())["shapes"]["tiny-bert"]
    assert kept["run"] == result["shapes"]["tiny-bert"]["run"]
    assert kept["measured_with"] == result["shapes"]["tiny-bert"]["measured_with"]
    assert [a["run"]["status"] for a in kept["failed_attempts"]] == ["skipped: budget spent"]
    assert "kept the stored rows of tiny-bert" in done.stderr
    # --rescore likewise: a later file's timed-out row does not replace an earlier file's row that ran.
    newer = tmp_path / "newer.json"
    timed_out = json.loads(older.read_text())
    timed_out["shapes"]["tiny-bert"]["run"] = {"status": "timeout", "timeout_s": 1}
    newer.write_text(json.dumps(timed_out))
    done = _run("--rescore", str(older), str(newer), "--out", str(merged))
    assert done.returncode == 0, done.stdout + done.stderr
    bert = json.loads(merged.read_text())["shapes"]["tiny-bert"]
    assert bert["run"]["status"] == "ok" and bert["measured_in"] == "older.json"
    assert bert["failed_attempts"][0]["run"]["status"] == "timeout"


def test_budget_and_run_timeout_leave_what_finished(tmp_path: Path) -> None:
    out = tmp_path / "shapes.json"
    # A 1 s run limit stops the first shape; the 21 s budget is then spent before the second could start usefully.
    done = _run("--small", "--shapes", "tiny-moe,tiny-gpt2-eager", "--run-timeout-s", "1", "--budget-s", "21",
                "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    shapes = json.loads(out.read_text())["shapes"]
    assert shapes["tiny-moe"]["run"]["status"] == "timeout", shapes["tiny-moe"]["run"]
    assert shapes["tiny-gpt2-eager"]["run"]["status"] == "skipped: budget spent"
    assert shapes["tiny-gpt2-eager"]["forecast"]["memory_bytes"] > 0


def test_bad_input_exits_2(tmp_path: Path) -> None:
    bad = _run("--small", "--shapes", "nope")
    assert bad.returncode == 2 and "unknown shape(s) nope; valid: tiny-gpt2-eager" in bad.stderr
    assert _run("--rescore", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.json")).returncode == 2
    not_ours = tmp_path / "other.json"
    not_ours.write_text('{"cells": {}}')
    done = _run("--rescore", str(not_ours), "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "is not a bench_gpu_shapes result file" in done.stderr
    assert "--rescore needs --out" in _run("--rescore", str(not_ours)).stderr
    assert not (tmp_path / "x.json").exists()


def test_a_truncated_results_file_is_refused_not_replaced(tmp_path: Path) -> None:
    """A file cut short by a kill mid-write (before writes were atomic) is one line and exit 2, and stays as it was."""
    out = tmp_path / "shapes.json"
    out.write_text('{"shapes": {"tiny-bert": {"run": {"sta')
    done = _run("--small", "--shapes", "tiny-bert", "--out", str(out))
    assert done.returncode == 2 and "cannot merge into" in done.stderr and "Traceback" not in done.stderr
    assert out.read_text() == '{"shapes": {"tiny-bert": {"run": {"sta'


def test_fp8_pairs_are_side_by_side_only_within_one_run() -> None:
    """An fp8/bf16 ratio of rows from two invocations (another lease, a cold machine) is marked as such."""
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_gpu_shapes import fp8_pairs, verdict

    def row(name: str, precision: str, tokens_per_s: float, run_id: str | None) -> dict:
        cell = {"name": name, "model": "llama3.2-1b", "micro_batch_size": 8, "context_length": 2048,
                "activation_checkpointing": False, "compile": True, "precision": precision}  # fmt: skip
        run = {"status": "ok", "tokens_per_s": tokens_per_s, "peak_memory_bytes": 1}
        return {"cell": cell, "run": run, **({"measured_with": {"run_id": run_id}} if run_id else {})}

    same = fp8_pairs({"b": row("b", "bf16-mixed", 100.0, "r1"), "f": row("f", "fp8", 120.0, "r1")})
    assert same["f"]["side_by_side"] is True and same["f"]["fp8_over_bf16_tokens_per_s"] == pytest.approx(1.2)
    apart = fp8_pairs({"b": row("b", "bf16-mixed", 100.0, "r1"), "f": row("f", "fp8", 120.0, "r2")})
    assert apart["f"]["side_by_side"] is False
    unknown = fp8_pairs({"b": row("b", "bf16-mixed", 100.0, None), "f": row("f", "fp8", 120.0, None)})
    assert unknown["f"]["side_by_side"] is False  # rows stored before run ids were recorded
    assert "not side by side" in verdict({"shapes": {}, "fp8": apart})
    assert "not side by side" not in verdict({"shapes": {}, "fp8": same})


def test_moe_mfu_counts_active_parameters() -> None:
    """The GPU set's MoE shape is forecast (and its MFU computed) from the parameters a token uses: 2 of 8 experts."""
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_gpu import _model_config
    from bench_gpu_shapes import GPU_SHAPES, forecast
    from gaudi3_scale.models import count_parameters, get_model_config

    cells = {c.name: c for c in GPU_SHAPES}
    moe, bert = (
        forecast(cells["moe-1b-top2"], "cuda", 989e12),
        forecast(cells["bert-base-mb32"], "cuda", 989e12),
    )
    assert 0.3 < moe["active_parameters"] / moe["parameters"] < 0.5
    assert bert["active_parameters"] == bert["parameters"]
    cfg = _model_config(cells["moe-1b-top2"], get_model_config).resolve_padding("cuda")
    active_matmul = count_parameters(cfg, trainable_only=False, exclude_embeddings=True, active=True)
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * cfg.context_length
    assert moe["flops_per_token"] == 6 * active_matmul + attention
    assert all(cells[n].measured_steps == 50 and cells[n].compile for n in ("moe-1b-top2", "bert-base-mb32"))
