"""Sharded (DCP) checkpoints resume on another world size and under another strategy, and the data stream goes on
exactly: across the resumed run no training sample is repeated or skipped (every sample read is recorded)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from gaudi3_scale.checkpoint.manifest import read_manifest, verify_checkpoint
from gaudi3_scale.checkpoint.reader import read_checkpoint

pytestmark = pytest.mark.distributed

RECORD = Path(__file__).with_name("record_samples.py")
COMMON = ["--train.max_steps=12", "--train.log_every_steps=1", "--train.val_every_steps=0",
          "--train.global_batch_size=8", "--optim.warmup_steps=2", "--train.micro_batch_size=2",
          "--checkpoint.every_steps=6", "--checkpoint.keep_last=2"]  # fmt: skip
STEP6 = "step-00000006"


def _run(out: Path, ranks: int, strategy: str) -> dict[int, Counter[str]]:
    """Train (or resume) in `out`; the samples read at each optimizer step, over all ranks and micro-steps."""
    args = [str(RECORD), str(out / "samples.jsonl"), f"--out_dir={out}", *COMMON,
            f"--parallel.nproc_per_node={ranks}", f"--parallel.strategy={strategy}"]  # fmt: skip
    if ranks > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the trainer (and its callbacks) are still held after fit(); the run's groups are gone all the same
    left = [(out / f"samples.jsonl.gloo-threads.rank{rank}").read_text() for rank in range(ranks)]
    assert left == ["0"] * ranks, (strategy, left)
    steps: dict[int, Counter[str]] = {}
    for path in sorted(out.glob("samples.jsonl.rank*")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], Counter()).update(record["samples"])
    for path in out.glob("samples.jsonl.rank*"):
        path.unlink()  # a resumed run in the same directory records afresh
    return steps


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train_loss"] for r in records if "train_loss" in r}


def _resume_copy(source: Path, target: Path) -> None:
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / STEP6, target / "checkpoints" / STEP6)
    (target / "checkpoints" / "latest").write_text(STEP6 + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reshard")
    single, sharded = root / "single", root / "fsdp2"
    samples = {"single": _run(single, 1, "auto"), "fsdp2": _run(sharded, 2, "fsdp")}
    (root / "samples.json").write_text(json.dumps({k: {s: dict(c) for s, c in v.items()}
                                                   for k, v in samples.items()}))  # fmt: skip
    return {"single": single, "fsdp2": sharded, "root": root}


def _samples(runs: dict[str, Path], name: str) -> dict[int, Counter[str]]:
    saved = json.loads((runs["root"] / "samples.json").read_text())[name]
    return {int(step): Counter(c) for step, c in saved.items()}


def test_fsdp_writes_one_shard_per_rank_committed_by_the_manifest(runs: dict[str, Path]) -> None:
    directory = runs["fsdp2"] / "checkpoints" / STEP6
    manifest = read_manifest(directory)
    assert manifest is not None and verify_checkpoint(directory) == []
    assert manifest["layout"] == "sharded" and manifest["world_size"] == 2 and manifest["strategy"] == "fsdp"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= set(manifest["files"])
    # Consolidated in one process, it holds the same tensors as the single-process run's single-file checkpoint.
    got = read_checkpoint(directory)
    want = read_checkpoint(runs["single"] / "checkpoints" / STEP6)
    assert got["state_dict"].keys() == want["state_dict"].keys()
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert got["optimizer_states"][0]["state"].keys() == want["optimizer_states"][0]["state"].keys()
    assert len(got["gaudi3_rng"]["per_rank"]) == 2  # every rank's generators


def test_the_data_stream_does_not_depend_on_world_size(runs: dict[str, Path]) -> None:
    single, sharded = _samples(runs, "single"), _samples(runs, "fsdp2")
    assert sorted(single) == list(range(12)) and single == sharded
    assert all(sum(c.values()) == 8 for c in single.values())  # a global batch of 8 sequences per step


@pytest.mark.parametrize(
    ("source", "ranks", "strategy"),
    [("fsdp2", 1, "auto"), ("fsdp2", 2, "ddp"), ("single", 2, "fsdp")],
    ids=["fsdp-2-ranks-to-1-process", "fsdp-to-ddp", "1-process-to-fsdp-2-ranks"],
)
def test_resume_on_another_world_size_and_strategy(
    runs: dict[str, Path], tmp_path: Path, source: str, ranks: int, strategy: str
) -> None:
    _resume_copy(runs[source], tmp_path)
    resumed = _run(tmp_path, ranks, strategy)
    reference = _samples(runs, "single")
    before = {step: c for step, c in _samples(runs, source).items() if step < 6}
    # Steps 6-11 read exactly the samples the uninterrupted run read: none repeated, none skipped.
    assert sorted(resumed) == list(range(6, 12))
    assert {**before, **resumed} == reference
    everything = sum((*before.values(), *resumed.values()), Counter())
    assert everything == sum(reference.values(), Counter())
    # And the math goes on: the same losses as the uninterrupted run (fp32 reduction order aside).
    full, got = _losses(runs["single"]), _losses(tmp_path)
    assert sorted(got) == list(range(7, 13))
    for step, loss in got.items():
        assert loss == pytest.approx(full[step], rel=1e-5), step
