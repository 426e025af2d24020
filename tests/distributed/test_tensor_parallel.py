"""Tensor parallel and 2-D meshes on real ranks (gloo, fp32): TP=2 and FSDP×TP (2×2) train llama-tiny like one
process over 12 steps — losses, gradient norms, validation loss and final weights within 1e-5 — reading the same
stream of samples (the ranks of a tensor-parallel group read the same batch); and their sharded (DCP) checkpoints
resume under another layout with the stream intact: TP=2 → one process, FSDP×TP → FSDP on 2 ranks and → HSDP
(2 replicas × 2 shards), which then train on like one process too.

Every layout runs with the default vocabulary padding, as a user's would: one process keeps the 65 characters,
tensor parallel pads them to 66 rows to split them over 2 ranks. The padding row takes no part in the softmax
(`models.vocab`), so the runs agree on everything but that row.

Four-rank launches are the slow part of the suite on 2 cores, hence one uninterrupted FSDP×TP run and HSDP only as
the resumed half (steps 7-12) rather than a run of its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from gaudi3_scale.checkpoint.manifest import read_manifest
from gaudi3_scale.checkpoint.reader import read_checkpoint

pytestmark = pytest.mark.distributed

RECORD = Path(__file__).with_name("record_samples.py")
# llama-tiny: 4 heads, 2 kv heads, ffn 192, context 64 all split over 2; the 65-character vocabulary is padded to 66
# under tensor parallel (`ModelConfig.resolve_padding`), not in one process.
COMMON = ["--model.name=llama-tiny", "--train.max_steps=12", "--train.log_every_steps=1",
          "--train.val_every_steps=6", "--train.val_batches=2", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--optim.warmup_steps=2", "--checkpoint.every_steps=6",
          "--checkpoint.keep_last=2"]  # fmt: skip
LAYOUTS = {  # name: (ranks, overrides)
    "single": (1, ["--train.threads=2"]),
    "tp2": (2, ["--parallel.tp_size=2"]),
    "fsdp_tp": (4, ["--parallel.tp_size=2"]),  # data parallel 2 × tensor parallel 2
}
# Tensor parallel sums each row-wise matmul in another order, so gradients differ at fp32 rounding (~1e-7
# relative); AdamW divides by sqrt(v), which magnifies that for elements whose gradient is near zero. After 20 steps
# the largest weight difference measured was 3.3e-6 (weights ~0.02); the losses stay within 1e-5 relative. A padding
# row in the softmax would put every loss log(66/65) ≈ 0.0153 (0.4 %) above one process's.
WEIGHT_ATOL = 1e-5
VOCAB = 65
VOCAB_TABLES = ("model.tok_embeddings.weight", "model.output.weight")  # [66, dim] under tensor parallel
STEP6, STEP12 = "checkpoints/step-00000006", "checkpoints/step-00000012"


def _run(out: Path, ranks: int, overrides: list[str], tp_size: int = 1) -> dict[int, Counter[str]]:
    """Train (or resume) in `out`; the samples each optimizer step read, over the data-parallel ranks."""
    args = [str(RECORD), str(out / "samples.jsonl"), f"--out_dir={out}", *COMMON,
            f"--parallel.nproc_per_node={ranks}", *overrides]  # fmt: skip
    if ranks > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    (out / "stderr.log").write_text(proc.stderr)
    assert proc.returncode == 0, f"{out / 'stderr.log'}: {proc.stderr[-3000:]}"
    per_rank = [(out / f"samples.jsonl.rank{rank}").read_text() for rank in range(ranks)]
    for rank in range(ranks):
        # The ranks of one tensor-parallel group read exactly the same micro-batches.
        assert per_rank[rank] == per_rank[rank - rank % tp_size], rank
        (out / f"samples.jsonl.rank{rank}").unlink()  # a resumed run in the same directory records afresh
    steps: dict[int, Counter[str]] = {}
    for text in per_rank[::tp_size]:
        for record in map(json.loads, text.splitlines()):
            steps.setdefault(record["step"], Counter()).update(record["samples"])
    return steps


def _metrics(out: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def _assert_close(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=1e-5), (what, step, got[step], value)


def _assert_weights_close(run: Path, single: Path) -> None:
    """The final weights of `run` (trained, or resumed, under tensor parallel) are those of the one-process run but
    for the vocabulary tables' padding row, which the one process does not have."""
    want = read_checkpoint(single / STEP12)["state_dict"]
    got = read_checkpoint(run / STEP12)["state_dict"]  # DCP shards consolidated to full tensors
    assert got.keys() == want.keys() and want.keys() >= set(VOCAB_TABLES)
    for key, value in want.items():
        if key in VOCAB_TABLES:  # the layouts really are padded differently
            assert (got[key].shape[0], value.shape[0]) == (VOCAB + 1, VOCAB), key
        torch.testing.assert_close(got[key][: value.shape[0]], value, rtol=1e-5, atol=WEIGHT_ATOL, msg=key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[int, Counter[str]]]]:
    root = tmp_path_factory.mktemp("tp")
    done = {}
    for name, (ranks, overrides) in LAYOUTS.items():
        tp = 2 if "--parallel.tp_size=2" in overrides else 1
        done[name] = (root / name, _run(root / name, ranks, overrides, tp_size=tp))
    return done


@pytest.mark.parametrize("layout", ["tp2", "fsdp_tp"])
def test_layout_trains_like_one_process(
    runs: dict[str, tuple[Path, dict[int, Counter[str]]]], layout: str
) -> None:
    (single, reference), (run, samples) = runs["single"], runs[layout]
    assert samples == reference and sorted(samples) == list(range(12))  # the same global batches, in order
    assert all(sum(c.values()) == 8 for c in samples.values())
    for key in ("train_loss", "grad_norm", "val_loss"):  # clipped at 1.0: the norm is the whole model's
        _assert_close(_metrics(run, key), _metrics(single, key), f"{layout} {key}")
    # samples/s counts the data-parallel ranks (a tensor-parallel pair reads one batch): × 64 tokens it is tokens/s
    tokens_per_s = _metrics(run, "tokens_per_s")
    for step, samples_per_s in _metrics(run, "samples_per_s").items():
        assert samples_per_s * 64 == pytest.approx(tokens_per_s[step], rel=1e-9), (layout, step)
    manifest = read_manifest(run / STEP12)
    assert manifest is not None and manifest["layout"] == "sharded"
    assert manifest["world_size"] == LAYOUTS[layout][0]
    _assert_weights_close(run, single)


@pytest.mark.parametrize(
    ("source", "ranks", "overrides"),
    [
        ("tp2", 1, ["--train.threads=2"]),
        ("fsdp_tp", 2, ["--parallel.strategy=fsdp"]),
        ("fsdp_tp", 4, ["--parallel.dp_replicate=2"]),
    ],
    ids=["tp2-to-1-process", "fsdp-x-tp-to-fsdp-2", "fsdp-x-tp-to-hsdp-2x2"],
)
def test_resume_under_another_layout(
    runs: dict[str, tuple[Path, dict[int, Counter[str]]]],
    tmp_path: Path,
    source: str,
    ranks: int,
    overrides: list[str],
) -> None:
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(runs[source][0] / STEP6, tmp_path / STEP6)
    (tmp_path / "checkpoints" / "latest").write_text("step-00000006\n")
    resumed = _run(tmp_path, ranks, overrides)
    single, reference = runs["single"]
    manifest = read_manifest(tmp_path / STEP12)
    assert manifest is not None and manifest["world_size"] == ranks
    # Steps 6-11 read exactly the samples the uninterrupted run read: none repeated, none skipped.
    assert resumed == {step: c for step, c in reference.items() if step >= 6}
    want = {step: loss for step, loss in _metrics(single, "train_loss").items() if step > 6}
    _assert_close(_metrics(tmp_path, "train_loss"), want, f"{source} resumed")
    want = {step: norm for step, norm in _metrics(single, "grad_norm").items() if step > 6}
    _assert_close(_metrics(tmp_path, "grad_norm"), want, f"{source} resumed")
    _assert_weights_close(tmp_path, single)
