"""Docs figures that cite a results JSON say what that JSON holds: its date, its loss band, and, for a ratio of rows
from separate device calls (`gpu_shapes_cuda_h200.json`'s fp8/bf16) or one worked out by hand
(`gpu_cuda_h100_fp8.json`), that it is not a side-by-side measurement printed by a command."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _paragraphs(page: str) -> list[str]:
    return re.split(r"\n\s*\n", (ROOT / "docs" / page).read_text(encoding="utf-8"))


def test_the_1gb_prepare_figures_carry_the_date_of_their_json() -> None:
    date = json.loads((RESULTS / "prepare_1gb.json").read_text())["machine"]["date"][:10]
    lines = [line for p in _paragraphs("data.md") for line in p.split("\n- ") if "prepare_1gb.json" in line]
    assert lines and all(date in line for line in lines), (date, lines)


def test_the_h100_fp8_loss_band_is_the_one_in_its_json() -> None:
    loss = json.loads((RESULTS / "gpu_cuda_h100_fp8.json").read_text())["loss_after_steps"]
    band = [100 * w["relative"] for w in loss["relative_per_window"] if w["step"] >= 110]
    quoted = f"{min(band):.1f}–{max(band):.1f} %"  # 1.1–2.5 %
    for page in ("fp8.md", "performance/gpu.md"):
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        bands = re.findall(r"(\d\.\d–\d\.\d %)[^.]*?step 110", text)
        assert bands == [quoted], (page, bands)


def test_the_fp8_ratios_are_labelled_for_what_they_are() -> None:
    ratio = json.loads((RESULTS / "gpu_shapes_cuda_h200.json").read_text())["fp8"]["llama3.2-1b-fp8-head"]
    quoted = f"{ratio['fp8_over_bf16_tokens_per_s']:.3f}"  # 1.229
    by_hand = f"{json.loads((RESULTS / 'gpu_cuda_h100_fp8.json').read_text())['loss_after_steps']['fp8_over_bf16_tokens_per_s']:.3f}"
    for page in ("fp8.md", "performance/gpu.md"):
        for paragraph in _paragraphs(page):
            if quoted in paragraph and "not a side-by-side" not in paragraph:
                assert "two separate calls" in paragraph or "two-call ratio" in paragraph, (page, paragraph)
            if by_hand in paragraph and "|" not in paragraph.split("\n")[0]:
                assert "by hand" in paragraph, (page, paragraph)
    table = [p for p in _paragraphs("performance/gpu.md") if f"{by_hand} × bf16" in p]
    assert table and all("by hand: see below | – | 224.6" in p for p in table)
