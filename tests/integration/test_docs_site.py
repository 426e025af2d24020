"""The documentation site: `mkdocs build --strict` passes (no broken link, no page left out of the nav), the README
stays a front page, and the charts on the pages are the files the benchmarks wrote."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# docs/img/NAME ← the benchmark output it is a copy of (mkdocs serves only files under docs/)
CHARTS = {
    "strategies_cpu.png": "benchmarks/results/strategies_cpu.png",
    "tune_cpu.png": "benchmarks/results/tune_cpu.png",
    "preemption_cpu.png": "benchmarks/results/preemption_cpu.png",
    "memory_estimate_cpu.png": "benchmarks/results/memory_estimate_cpu.png",
    "activation_checkpointing_cpu.png": "benchmarks/results/activation_checkpointing_cpu.png",
    "gpu_cuda.png": "benchmarks/results/gpu_cuda.png",
    "gpu_shapes_cuda_h200.png": "benchmarks/results/gpu_shapes_cuda_h200.png",
    "cost_llama3_70b_1T.png": "benchmarks/results/cost_llama3_70b_1T/cost.png",
    "benchmark_throughput_vs_world_size.png": "benchmarks/results/benchmark_cpu_small/report/throughput_vs_world_size.png",
    "benchmark_peak_memory.png": "benchmarks/results/benchmark_cpu_small/report/peak_memory.png",
    "plan_scale_out.png": "benchmarks/results/plan_scale_out.png",
}


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mkdocs", reason="the `docs` extra (also in `test`) is not installed")
    pytest.importorskip("material", reason="the `docs` extra (also in `test`) is not installed")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_site_builds_strict(tmp_path: Path) -> None:
    proc = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = tmp_path / "site"
    for page in ("index.html", "how-to/fine-tune-hf-llama/index.html", "reference/cli/index.html"):
        assert (site / page).is_file(), page
    assert "gaudi3 deploy render" in (site / "reference/cli/index.html").read_text(encoding="utf-8")
    assert (site / "img/tune_cpu.png").is_file()


def test_strict_build_fails_on_a_broken_link(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "how-to" / "serve.md"
    page.write_text(
        page.read_text(encoding="utf-8") + "\nSee [nowhere](no-such-page.md).\n", encoding="utf-8"
    )
    proc = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0 and "no-such-page.md" in proc.stderr, proc.stderr[-3000:]


def test_readme_is_a_front_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert "```bash\npython3 run.py train\npython3 run.py test\n```\n" in text  # the quick start CI runs
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to a missing {target}"


def test_newcomer_questions_are_one_click_from_home() -> None:
    home = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for target in (
        "how-to/fine-tune-hf-llama.md",
        "get-started/multi-process.md#several-nodes",
        "how-to/plan-cost.md",
    ):
        assert f"]({target})" in home, target


@pytest.mark.parametrize("name", sorted(CHARTS))
def test_charts_are_the_benchmarks_outputs(name: str) -> None:
    assert (ROOT / "docs" / "img" / name).read_bytes() == (ROOT / CHARTS[name]).read_bytes(), (
        f"docs/img/{name} differs from {CHARTS[name]}: copy the benchmark's new output"
    )
