"""Pipeline parallel on real ranks (gloo, fp32), through `gaudi3 train` under torchrun: PP 2 with each schedule
(GPipe with `train.compile`: each stage's blocks compiled), PP 2 × FSDP 2 and PP 2 × TP 2 (4 ranks), PP 2 × FSDP 2
× TP 2 and PP 2 × HSDP 2×2 (8 ranks) train a 4-layer llama-tiny like one process over 12 steps — losses,
gradient norms (the whole model's: clipped at 1.0 over all stages) and validation losses within 1e-5, final weights
within 1e-5 — and a pipeline checkpoint (DCP, each rank its stage's tensors) resumes bit-exactly under PP 2, and in one process, under FSDP 2, FSDP 4 (from PP 2 × FSDP 2)
and PP 4 with one process's losses; `init_from` fills two stages with a Hugging Face Llama.

Launches of 4 and 8 ranks are slow on 2 cores: one run each for the layouts with a second parallel dimension and
the two 3-D ones, and the resumes that change the world size (PP 2 × FSDP 2 → FSDP 4, PP 2 → PP 4)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gaudi3_scale.checkpoint.manifest import read_manifest
from gaudi3_scale.checkpoint.reader import read_checkpoint

pytestmark = pytest.mark.distributed

# 4 layers: two stages per rank for interleaved_1f1b and zbv; accumulation 4 (8 sequences, micro-batch 2, one
# data-parallel rank) is the pipeline's micro-batch count; 2 with FSDP 2.
COMMON = ["--model.name=llama-tiny", "--model.num_layers=4", "--train.max_steps=12", "--train.log_every_steps=1",
          "--train.val_every_steps=6", "--train.val_batches=2", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--optim.warmup_steps=2", "--checkpoint.every_steps=6",
          "--checkpoint.keep_last=2", "--sample-tokens=0", "--no-progress"]  # fmt: skip
HSDP = [
    "--parallel.pp_size=2",
    "--parallel.dp_replicate=2",
    "--train.micro_batch_size=1",
    "--train.val_batches=4",
]
LAYOUTS = {  # name: (ranks, overrides)
    "single": (1, ["--train.threads=2"]),
    **{
        f"pp2-{schedule}": (2, ["--parallel.pp_size=2", f"--parallel.pp_schedule={schedule}"])
        for schedule in ("1f1b", "interleaved_1f1b", "zbv")
    },
    # GPipe with train.compile: each stage's blocks compiled (Inductor's C++ on the CPU), the rest eager
    "pp2-gpipe-compiled": (
        2,
        ["--parallel.pp_size=2", "--parallel.pp_schedule=gpipe", "--train.compile=true"],
    ),
    "pp2-fsdp2": (4, ["--parallel.pp_size=2"]),  # pipeline 2 × data parallel 2 (FSDP)
    "pp2-tp2": (4, ["--parallel.pp_size=2", "--parallel.tp_size=2"]),  # pipeline 2 × tensor parallel 2
    # the 3-D mesh: pipeline 2 × FSDP 2 × tensor parallel 2; pipeline 2 × HSDP (2 replicas × 2 shards), whose
    # 4 data-parallel ranks read 2 sequences each: micro-batches of 1 give the pipeline its 2 (and 4 validation
    # micro-batches of 1 are one process's 2 of 2 windows)
    "pp2-fsdp2-tp2": (8, ["--parallel.pp_size=2", "--parallel.tp_size=2"]),
    "pp2-hsdp2x2": (8, HSDP),
}
INDUCTOR_CACHE = "inductor-cache"
STEP6, STEP12 = "checkpoints/step-00000006", "checkpoints/step-00000012"
VOCAB = (
    65  # tensor parallel pads the vocabulary tables to 66 rows (tests/distributed/test_tensor_parallel.py)
)


def _train(out: Path, ranks: int, overrides: list[str]) -> None:
    args = ["-m", "gaudi3_scale.cli", "train", f"--out={out}", *COMMON, f"--parallel.nproc_per_node={ranks}",
            *overrides]  # fmt: skip
    if ranks > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(out / INDUCTOR_CACHE),
    }  # what Inductor generated, if any
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)
    (out / "stderr.log").write_text(proc.stderr)
    assert proc.returncode == 0, f"{out / 'stderr.log'}: {proc.stderr[-3000:]}"


def _metrics(out: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def _assert_close(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert sorted(got) == sorted(want) and want, what
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=1e-5), (what, step, got[step], value)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp")
    for name, (ranks, overrides) in LAYOUTS.items():
        (root / name).mkdir()
        _train(root / name, ranks, overrides)
    return {name: root / name for name in LAYOUTS}


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single"])
def test_layout_trains_like_one_process(runs: dict[str, Path], layout: str) -> None:
    single, run = runs["single"], runs[layout]
    kernels = list(
        (run / INDUCTOR_CACHE).rglob("*.py")
    )  # the code Inductor generated for the compiled blocks
    assert bool(kernels) == layout.endswith("-compiled"), (layout, kernels[:3])
    for key in ("train_loss", "grad_norm", "val_loss"):
        _assert_close(_metrics(run, key), _metrics(single, key), f"{layout} {key}")
    assert sorted(_metrics(run, "val_loss")) == [6, 12]
    manifest = read_manifest(run / STEP12)
    assert manifest is not None and manifest["layout"] == "sharded"
    assert manifest["world_size"] == LAYOUTS[layout][0]
    want = read_checkpoint(single / STEP12)["state_dict"]
    got = read_checkpoint(run / STEP12)["state_dict"]  # every stage's tensors, consolidated
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key][: value.shape[0]], value, rtol=1e-5, atol=1e-5, msg=key)


def _resume(source: Path, out: Path, ranks: int, overrides: list[str]) -> None:
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / STEP6, out / STEP6)
    (out / "checkpoints" / "latest").write_text("step-00000006\n")
    _train(out, ranks, overrides)


def test_a_pipeline_checkpoint_resumes_bit_exactly_under_the_same_layout(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    uninterrupted = runs["pp2-1f1b"]
    _resume(uninterrupted, tmp_path, *LAYOUTS["pp2-1f1b"])
    for key in ("train_loss", "grad_norm"):
        want = {step: value for step, value in _metrics(uninterrupted, key).items() if step > 6}
        assert _metrics(tmp_path, key) == want, key  # bit for bit
    want = read_checkpoint(uninterrupted / STEP12)
    got = read_checkpoint(tmp_path / STEP12)
    for key, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key
    for (_, want_state), (_, got_state) in zip(
        sorted(want["optimizer_states"][0]["state"].items()),
        sorted(got["optimizer_states"][0]["state"].items()),
        strict=True,
    ):
        assert all(torch.equal(got_state[k], v) for k, v in want_state.items())


@pytest.mark.parametrize(
    ("source", "ranks", "overrides"),
    [
        ("pp2-1f1b", 1, ["--train.threads=2"]),
        ("pp2-1f1b", 2, ["--parallel.strategy=fsdp"]),
        ("pp2-fsdp2", 4, ["--parallel.strategy=fsdp"]),
        ("pp2-1f1b", 4, ["--parallel.pp_size=4"]),  # 4 layers: one per stage
    ],
    ids=["pp2-to-1-process", "pp2-to-fsdp2", "pp2xfsdp2-to-fsdp4", "pp2-to-pp4"],
)
def test_a_pipeline_checkpoint_resumes_under_another_layout(
    runs: dict[str, Path], tmp_path: Path, source: str, ranks: int, overrides: list[str]
) -> None:
    _resume(runs[source], tmp_path, ranks, overrides)
    single = runs["single"]
    for key in ("train_loss", "grad_norm"):
        want = {step: value for step, value in _metrics(single, key).items() if step > 6}
        _assert_close(_metrics(tmp_path, key), want, f"resumed {key}")
    want = read_checkpoint(single / STEP12)["state_dict"]
    got = read_checkpoint(tmp_path / STEP12)["state_dict"]
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_init_from_a_hugging_face_llama_into_two_stages(tmp_path: Path) -> None:
    """Each stage reads only its layers of a sharded HF checkpoint: with lr 1e-30 (below every weight's ulp) the
    weights stay the checkpoint's, bitwise those one process loads, and the validation loss is one process's (whose
    logits are transformers', tests/integration/test_init_from.py)."""
    from hf_checkpoints import load_ours, save_hf_checkpoints, save_tokenizer

    text = "ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet is the sun.\n" * 20
    directory = save_hf_checkpoints(tmp_path / "hf")["llama-sharded"]  # 2 layers: one per stage
    save_tokenizer(directory, text)
    (tmp_path / "text.txt").write_text(text)
    args = [f"--model.init_from={directory}", "--model.context_length=32", "--optim.lr=1e-30", "--optim.min_lr=0",
            "--optim.warmup_steps=0", "--train.global_batch_size=4", "--train.micro_batch_size=2",
            "--train.max_steps=2", "--train.val_every_steps=2", "--train.val_batches=1", "--train.log_every_steps=1",
            "--checkpoint.every_steps=2", f"--data.source={tmp_path / 'text.txt'}",
            f"--data.prepared_dir={tmp_path / 'prepared'}", "--sample-tokens=0", "--no-progress"]  # fmt: skip
    runs = {}
    for name, ranks, layout in (("single", 1, []), ("pp2", 2, ["--parallel.pp_size=2"])):
        out = runs[name] = tmp_path / name
        out.mkdir()
        cmd = [
            "-m",
            "gaudi3_scale.cli",
            "train",
            f"--out={out}",
            *args,
            f"--parallel.nproc_per_node={ranks}",
            *layout,
        ]
        if ranks > 1:
            cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *cmd]
        proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_close(
        _metrics(runs["pp2"], "val_loss"), _metrics(runs["single"], "val_loss"), "init_from val_loss"
    )
    weights = read_checkpoint(runs["pp2"] / "checkpoints/step-00000002")["state_dict"]
    for key, tensor in load_ours(directory).named_parameters():
        assert torch.equal(weights[f"model.{key}"], tensor), key


def test_a_pipeline_checkpoint_exports_to_hugging_face_with_one_process_logits(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """`gaudi3 ckpt export --format hf` consolidates the stages' DCP shards: transformers loads the PP 2 run's
    export, and its logits are those of the one-process run's export (weights equal within 1e-5, above)."""
    from transformers import LlamaForCausalLM

    logits = {}
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    for name in ("single", "pp2-1f1b"):
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "ckpt", "export", str(runs[name] / STEP12),
                               "--format", "hf", "--out", str(out)], capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        model = LlamaForCausalLM.from_pretrained(out, local_files_only=True)
        with torch.no_grad():
            logits[name] = model.eval()(tokens).logits
    torch.testing.assert_close(logits["pp2-1f1b"], logits["single"], rtol=1e-5, atol=1e-5)
