"""A weighted mixture of sharded datasets: resumed on another world size it reads exactly the samples an
uninterrupted run reads (every sample each rank trains on is hashed), in the weights' proportions; its validation
reads every member, and 2 ranks validate on the 1-process run's windows, each rank on its half."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gaudi3_scale.data import DataConfig, prepare_dataset
from gaudi3_scale.data.sources import bundled_corpora

pytestmark = pytest.mark.distributed

RECORD = Path(__file__).with_name("record_samples.py")
STEP6 = "step-00000006"
COMMON = ["--train.max_steps=12", "--train.log_every_steps=1", "--train.val_every_steps=0",
          "--train.global_batch_size=8", "--optim.warmup_steps=2", "--train.micro_batch_size=2",
          "--checkpoint.every_steps=6", "--checkpoint.keep_last=2", "--model.context_length=32",
          "--data.shuffle_block_shards=2", "--data.tokenizer=byte"]  # fmt: skip


def _run(out: Path, ranks: int, mixture: str, *extra: str) -> dict[int, Counter[str]]:
    args = [str(RECORD), str(out / "samples.jsonl"), f"--out_dir={out}", *COMMON, f"--data.mixture={mixture}",
            f"--parallel.nproc_per_node={ranks}", "--parallel.strategy=" + ("ddp" if ranks > 1 else "auto"),
            *extra]  # fmt: skip
    if ranks > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "stderr.txt").write_text(proc.stderr)
    steps: dict[int, Counter[str]] = {}
    for path in sorted(out.glob("samples.jsonl.rank*")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], Counter()).update(record["samples"])
        path.unlink()
    return steps


@pytest.fixture(scope="module")
def mixture(tmp_path_factory: pytest.TempPathFactory) -> str:
    text = bundled_corpora()["tinyshakespeare"].read_text()
    members = []
    for name, part, weight in (("early", text[:40_000], 7), ("late", text[-20_000:], 3)):
        source = tmp_path_factory.mktemp(name) / f"{name}.txt"
        source.write_text(part)
        cfg = DataConfig(source=str(source), tokenizer="byte", shard_mb=0.004)
        directory = prepare_dataset(cfg, tmp_path_factory.mktemp(f"{name}-ds"), progress=False)
        members.append({"source": str(directory), "weight": weight, "name": name})
    return json.dumps(members)


def test_mixture_resumes_on_another_world_size_sample_for_sample(mixture: str, tmp_path: Path) -> None:
    single = _run(tmp_path / "single", 1, mixture)
    assert sorted(single) == list(range(12)) and all(sum(c.values()) == 8 for c in single.values())
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "single" / "checkpoints" / STEP6, resumed_dir / "checkpoints" / STEP6)
    (resumed_dir / "checkpoints" / "latest").write_text(STEP6 + "\n")
    resumed = _run(resumed_dir, 2, mixture)
    assert sorted(resumed) == list(range(6, 12))
    assert {**{s: c for s, c in single.items() if s < 6}, **resumed} == single
    # the final validation (train.val_batches 20 over 7:3 = 14 + 6 micro-batches of 2): each rank its own half
    # (Lightning's DistributedSampler halved it again), together the 1-process run's windows
    single_val, (rank0, rank1) = _val(tmp_path / "single"), _val(resumed_dir)
    assert sum(single_val[0].values()) == 40 and len(single_val[0]) == 40
    assert sum(rank0.values()) == sum(rank1.values()) == 20 and rank0 + rank1 == single_val[0]


def test_every_member_is_validated_with_fewer_val_batches_than_members(mixture: str, tmp_path: Path) -> None:
    _run(tmp_path, 1, mixture, "--train.max_steps=1", "--train.val_batches=1", "--checkpoint.every_steps=0")
    (val,) = _val(tmp_path)
    assert sum(val.values()) == 4  # a micro-batch of each member, not the first member's only
    warning = "train.val_batches=1 is fewer than the 2 data.mixture members with a weight: validating on 2"
    assert warning in (tmp_path / "stderr.txt").read_text()


def _val(out: Path) -> list[Counter[str]]:
    """The windows each rank validated on at the run's last step (one file per rank)."""
    ranks = []
    for path in sorted(out.glob("samples.jsonl.val.rank*")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        last = max(r["step"] for r in records)
        ranks.append(Counter(h for r in records if r["step"] == last for h in r["samples"]))
    return ranks
