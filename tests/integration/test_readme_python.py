"""Every ```python block of the README and the docs site (docs/**/*.md) runs as written on this CPU, and does what the
text around it says (the blocks moved from the README into the docs: reference/python.md, hardware.md, how-to/plan-cost.md)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.device.hpu import hpu_available

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [
    block
    for page in PAGES
    for block in re.findall(
        r"^```python\n(.*?)^```$", page.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE
    )
]

# Each block is recognised by one line it contains; every block must be claimed by exactly one test.
MARKERS = {
    "gaudi_trainer": "summary = GaudiTrainer(cfg).fit()",
    "accelerator": "accelerator=GaudiAccelerator()",
    "optimizer_precision": "GaudiOptimizer.FusedAdamW(",
    "batch_finder": "micro_batch_size = finder.find_optimal_batch_size()",
    "memory": "model = memory.optimize_model(model)",
    "profiler": "prof.export_chrome_trace(",
    "cost": "result = CostAnalyzer().compare_training_cost(",
}


def _block(key: str) -> str:
    (block,) = [b for b in BLOCKS if MARKERS[key] in b]
    return block


def _run(key: str, where: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.chdir(where)
    namespace: dict[str, Any] = {"__name__": f"readme_{key}"}
    exec(compile(_block(key), f"docs[{key}]", "exec"), namespace)
    return namespace


def test_every_python_block_is_tested() -> None:
    claimed = [[key for key, marker in MARKERS.items() if marker in block] for block in BLOCKS]
    assert all(len(keys) == 1 for keys in claimed), claimed
    assert len(BLOCKS) == len(MARKERS)


def test_gaudi_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = _run("gaudi_trainer", tmp_path, monkeypatch)
    assert (
        ns["summary"]["steps"] == 20 and 0 < ns["summary"]["train_loss"] < 4.2
    )  # ln(65) = 4.17 at the start
    assert ns["summary"]["tokens_per_s"] > 0
    assert (tmp_path / "runs" / ns["cfg"].name / "checkpoints" / "latest").exists()


@pytest.mark.skipif(hpu_available(), reason="checks the refusal off Gaudi")
def test_gaudi_accelerator_says_gaudi_is_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserInputError, match=r"^Gaudi \(HPU\) was requested but no HPU is usable here"):
        _run("accelerator", tmp_path, monkeypatch)


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])  # the block's "or:" comment
def test_optimizer_falls_back_and_either_trainer_takes_the_precision_plugin(
    namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gaudi3_scale.device import optim, precision

    block = _block("optimizer_precision")
    assert "import lightning.pytorch as pl  # or: import pytorch_lightning as pl" in block
    monkeypatch.setattr(optim, "_WARNINGS", type(optim._WARNINGS)())  # fresh once-only caches for this test
    monkeypatch.setattr(precision, "_WARNINGS", type(precision._WARNINGS)())
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {"__name__": "readme_optimizer_precision"}
    code = block.replace("import lightning.pytorch as pl", f"import {namespace} as pl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code, "docs[optimizer_precision]", "exec"), ns)
    messages = [str(w.message) for w in caught if "gaudi3" in w.filename or "Gaudi" in str(w.message)]
    assert [m for m in messages if "GaudiOptimizer" in m] == [
        "GaudiOptimizer.FusedAdamW(use_habana=True): no Gaudi (HPU) is usable here; using torch.optim.AdamW"
    ]
    assert not [m for m in messages if "GaudiMixedPrecision" in m], (
        messages
    )  # every option asked for takes effect
    assert type(ns["optimizer"]) is torch.optim.AdamW and ns["optimizer"].defaults["fused"] is True
    plugin = ns["precision"]
    assert plugin.precision == "bf16-mixed" and plugin.use_flash_attention_v2 and plugin.cache_fp32_weights
    assert ns["trainer"].precision_plugin is plugin and ns["pl"].__name__ == namespace


def test_batch_finder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"  # a calibration store of this test's own (the trials inherit it)
    monkeypatch.setenv("GAUDI3_CACHE", str(cache))
    ns = _run("batch_finder", tmp_path, monkeypatch)
    best = ns["finder"].result.best
    assert ns["micro_batch_size"] in (1, 2, 4) and ns["micro_batch_size"] == best.candidate.micro_batch_size
    assert ns["finder"].result.best_config.train.micro_batch_size == ns["micro_batch_size"]
    assert best.tokens_per_s > 0
    assert ns["finder"].config.memory_budget_bytes > 2**30 and (ns["finder"].out_dir / "best.yaml").is_file()
    # on_trial=feed_tune_trial: the winning trial is a probe of its layout in this machine's calibration store
    (store,) = (cache / "calibration").glob("*.json")
    origins = {p["origin"] for p in json.loads(store.read_text())["probes"].values()}
    assert f"tune trial {ns['finder'].out_dir}/trials/{best.candidate.key}" in origins


def test_memory_optimizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = _run("memory", tmp_path, monkeypatch)
    assert ns["memory"].checkpointed_blocks == ns["model"].config.num_layers and ns[
        "memory"
    ].trainer_kwargs() == {"accumulate_grad_batches": 4}
    assert 3.9 < float(ns["loss"]) < 4.5  # an untrained model over 65 characters: about ln(65) = 4.17
    assert all(p.grad is not None for p in ns["model"].parameters() if p.requires_grad)


def test_profiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _run("profiler", tmp_path, monkeypatch)
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"} <= names and "aten::addmm" in names
    out = capsys.readouterr().out
    assert "aten::addmm" in out and "peak net allocation in the window" in out


def test_cost_analyzer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = _run("cost", tmp_path, monkeypatch)
    assert (tmp_path / "tco.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "cost_analysis.pdf").read_bytes()[:5] == b"%PDF-"
    platforms = [row.platform for row in ns["result"].rows]
    assert platforms == ["gaudi3", "h100", "a100"]
