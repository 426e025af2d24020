"""Llama 3 8B on one GPU from a locally written Hugging Face checkpoint (issue #42, item 5): the estimator's layout,
20 real `gaudi3 train` steps from `model.init_from`, then `gaudi3 ckpt export`.

Phases, each written as it ends to `<out stem>.partial.json` (a lease cut short keeps what finished), which
replaces `--out` at the end unless `--out` holds a complete result (every phase ok) and this run is not: then the
stored one stays and the partial file is left beside it (said on stderr):

1. estimate: `tune.memory.estimate_memory` for one-rank FSDP layouts, fastest first as `tune.layouts` ranks them
   (offload none < all, activation checkpointing off < on; then bf16-mixed before bf16-true). The first one whose
   device peak fits `TARGET_UTILIZATION` of the device's memory, whose offloaded host share fits the host's RAM and
   whose files fit the disks (the HF checkpoint, the run's full checkpoint: weights + AdamW moments, the export)
   is the one run. Every candidate is recorded with why it was passed over. On an H200 (139 GiB) at context 8192,
   micro-batch 1, that is bf16-true without offload or checkpointing (estimate 106.9 GiB; bf16-mixed needs 163.6
   GiB without activation checkpointing, 121.6 GiB with it but a 96 GB checkpoint).
2. write: `LlamaForCausalLM` of the preset's shape (`models.hf.hf_llama_config`), random, bf16, built on the GPU
   (random init of 8 B parameters on a CPU takes minutes), `save_pretrained` sharded safetensors — in a worker
   process, so this one never holds device memory while the run measures its peak.
3. train: `gaudi3 train --model.init_from DIR` on synthetic ids for 20 steps, eager (checkpoint and one validation
   batch only at the end); from its summary.json: peak memory (`torch.cuda.max_memory_allocated`), step time, tokens/s,
   MFU (6N + 12·L·H·Q·T over the dense BF16 peak, `models/counting.py`), and the estimate's error against it;
   a run stopped by the budget after its last step (in its final save) gives them from metrics.jsonl's last window.
4. export: the HF checkpoint is deleted (the run has read it), then `gaudi3 ckpt export --format hf`; the export's
   tensors are counted against the preset's parameter count.

    timeout 270 python benchmarks/gpu_llama8b.py --budget-s 240  # on the GPU: results/llama8b_cuda_<gpu>.json
    python benchmarks/gpu_llama8b.py --small --out /tmp/llama8b_small.json  # the tiny CPU dry-run (< 3 min)

`--small` (the default without CUDA) runs llama-tiny's shape through the same phases on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import RESULTS, ROOT, _peak_flops, _tail, run_cli
from bench_gpu_shapes import _relative
from gaudi3_scale.bench.result import load_stored_results, write_json_atomic
from gaudi3_scale.tune.config import TuneConfig

# What `gaudi3 tune` lets a chosen config use of the device's memory.
TARGET_UTILIZATION = TuneConfig().target_utilization
_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Shape:
    preset: str  # registry model whose shape the HF checkpoint gets
    model_overrides: dict[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None  # None = the preset's
    context_length: int
    micro_batch_size: int
    steps: int
    warmup_steps: int  # of `steps`, left out of the step time (train.throughput_warmup_steps)
    max_shard_size: str  # save_pretrained's shards


# The published shape at its pre-training context (registry: Meta-Llama-3-8B params.json); eager, since compiling
# 8 B parameters' graph would take a good part of the device time.
GPU_SHAPE = Shape(preset="llama3-8b", context_length=8192, micro_batch_size=1, steps=20, warmup_steps=3,
                  max_shard_size="5GB")  # fmt: skip
SMALL_SHAPE = Shape(preset="llama-tiny", vocab_size=512, context_length=64, micro_batch_size=2, steps=20,
                    warmup_steps=3, max_shard_size="50KB")  # fmt: skip
# (offload, activation checkpointing, precision), fastest first (tune.layouts' ranking, then precision).
PRECISIONS = ("bf16-mixed", "bf16-true")
CANDIDATES = [(offload, ckpt, precision) for offload in ("none", "all") for ckpt in (False, True)
              for precision in PRECISIONS]  # fmt: skip


def model_config(shape: Shape, device: str) -> Any:
    from gaudi3_scale.models import get_model_config

    cfg = get_model_config(shape.preset)
    vocab = shape.vocab_size or cfg.vocab_size
    return replace(
        cfg, **shape.model_overrides, vocab_size=vocab, context_length=shape.context_length
    ).resolve_padding(device)


def file_bytes(cfg: Any, precision: str) -> dict[str, int]:
    """Bytes each artefact takes on disk: the bf16 HF checkpoint, the run's full checkpoint (weights and both AdamW
    moments as `tune.activations.element_bytes` stores them; the run's small files left out) and the bf16 export."""
    from gaudi3_scale.models import count_parameters
    from gaudi3_scale.tune.activations import element_bytes

    n = count_parameters(cfg, trainable_only=False)
    e = element_bytes(precision, "fsdp")
    return {"hf": 2 * n, "checkpoint": n * (e.weight + 2 * e.state + e.master), "export": 2 * n}


def _free_roots() -> dict[str, int]:
    """Free bytes (less a margin) of each filesystem a run could write to: the temp dir, /dev/shm, the repository."""
    roots: dict[str, int] = {}
    seen = set()
    for root in (tempfile.gettempdir(), "/dev/shm", str(ROOT)):
        if os.path.isdir(root) and os.access(root, os.W_OK) and (dev := os.stat(root).st_dev) not in seen:
            seen.add(dev)
            roots[root] = int(shutil.disk_usage(root).free * TARGET_UTILIZATION)
    return roots


def place(need: dict[str, int], roots: dict[str, int]) -> dict[str, str] | None:
    """A root for each artefact in `need`, largest first on the root with most room left; None when one does not
    fit. The HF checkpoint is deleted before the export is written, so the export takes its room."""
    left = dict(roots)
    out: dict[str, str] = {}
    for name in sorted((k for k in need if k != "export"), key=need.__getitem__, reverse=True):
        root = max(left, key=left.__getitem__)
        if need[name] > left[root]:
            return None
        out[name], left[root] = root, left[root] - need[name]
    if "export" in need:
        out["export"] = out["hf"]
    return out


def choose_layout(cfg: Any, shape: Shape, device: str, device_bytes: int, host_bytes: int,
                  precisions: tuple[str, ...] = PRECISIONS) -> dict[str, Any]:  # fmt: skip
    """Every candidate's estimate and verdict; `chosen` is the first that fits the device, the host and, with its
    checkpoint and export, the disks. When none does with them, the first that fits without them runs with no
    checkpoint (`save` false; the export is then skipped): the 20 steps' numbers are still measured."""
    from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
    from gaudi3_scale.tune.memory import estimate_memory

    roots = _free_roots()
    budget = int(device_bytes * TARGET_UTILIZATION)
    rows = []
    for offload, ckpt, precision in CANDIDATES:
        if precision not in precisions:
            continue
        if offload != "none" and device == "cpu":
            continue  # on a CPU the host is the device: nothing to offload to
        plan = ParallelPlan.build(
            strategy="fsdp", world_size=1, offload=offload, activation_checkpointing=ckpt
        )
        batch = BatchPlan.from_micro_batch(shape.micro_batch_size, context_length=shape.context_length)
        est = estimate_memory(cfg, plan, batch, precision=precision, device_kind=device)
        need = file_bytes(cfg, precision)
        reason = (f"needs {est.total_bytes / _GIB:.1f} GiB of the {budget / _GIB:.1f} GiB budget"
                  if est.total_bytes > budget else
                  f"offload needs {est.host_bytes / _GIB:.1f} GiB of {host_bytes / _GIB:.1f} GiB host memory"
                  if est.host_bytes > host_bytes * TARGET_UTILIZATION else "")  # fmt: skip
        # Files in RAM (/dev/shm) would compete with what offload keeps in host memory.
        room = {k: v for k, v in roots.items() if offload == "none" or k != "/dev/shm"}
        places = place(need, room)
        rows.append({"offload": offload, "activation_checkpointing": ckpt, "precision": precision,
                     "estimate_bytes": est.total_bytes, "estimate_parts_bytes": {**dict(est.rows()),
                     "peak_phase": est.peak_phase}, "host_bytes": est.host_bytes, "file_bytes": need,
                     "fits": not reason, "reason": reason, "files_fit": places is not None,
                     "places": places or place({"hf": need["hf"]}, room)})  # fmt: skip
    fitting = [r for r in rows if r["fits"] and r["places"]]
    chosen = next((r for r in fitting if r["files_fit"]), fitting[0] if fitting else None)
    if chosen is not None:
        chosen = {**chosen, "save": chosen["files_fit"]}
    return {"device_bytes": device_bytes, "budget_bytes": budget, "host_bytes": host_bytes, "free_bytes": roots,
            "candidates": rows, "chosen": chosen}  # fmt: skip


def write_hf(shape: Shape, directory: Path, device: str) -> None:
    """(worker) A random bf16 `LlamaForCausalLM` of `shape`, built on `device`, saved as sharded safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gaudi3_scale.models.hf import hf_llama_config

    config = LlamaConfig(**hf_llama_config(model_config(shape, device), dtype=torch.bfloat16))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=shape.max_shard_size, safe_serialization=True)


def train_args(shape: Shape, chosen: dict[str, Any], hf: Path, run: Path, device: str) -> list[str]:
    return ["train", "--out", str(run), "--resume", "never", "--no-progress", "--sample-tokens", "0",
            f"--model.init_from={hf}", f"--model.context_length={shape.context_length}",
            f"--data.source=synthetic:{model_config(shape, device).vocab_size}",
            f"--train.micro_batch_size={shape.micro_batch_size}",
            f"--train.global_batch_size={shape.micro_batch_size}", f"--train.precision={chosen['precision']}",
            "--train.compile=false", f"--train.max_steps={shape.steps}",
            f"--train.throughput_warmup_steps={shape.warmup_steps}", "--train.val_every_steps=0",
            "--train.val_batches=1", f"--checkpoint.enabled={str(chosen['save']).lower()}",
            "--checkpoint.every_steps=0", "--checkpoint.async_save=false",
            "--parallel.strategy=fsdp", f"--parallel.offload={chosen['offload']}",
            f"--parallel.activation_checkpointing={str(chosen['activation_checkpointing']).lower()}",
            "--optim.lr=3e-5", "--optim.min_lr=3e-6", "--optim.grad_clip_norm=1.0"]  # fmt: skip


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def export_tensors(directory: Path) -> int:
    """Elements in the exported safetensors files (read from their headers)."""
    from gaudi3_scale.models.pretrained import import_safe_open

    safe_open = import_safe_open()
    total = 0
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())  # noqa: SIM118
    return total


def _device_tag(device: str) -> str:
    """cpu, or cuda_<accelerator> (cuda_h200) for the result file's name."""
    if device == "cpu":
        return "cpu"
    import torch

    from gaudi3_scale.device.specs import find_accelerator

    spec = find_accelerator(torch.cuda.get_device_name())
    return f"cuda_{spec.name.split('-')[0]}" if spec else "cuda"


def _memory_bytes(device: str) -> tuple[int, int]:
    """(the device's memory, the host's RAM) in bytes; on a CPU both are the host's."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device == "cpu":
        return host, host
    import torch

    return torch.cuda.get_device_properties(0).total_memory, host


def write_phase(shape: Shape, hf: Path, device: str, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Phase 2 in a worker process (`--write-hf`): its status, files and wall time."""
    cmd = [sys.executable, __file__, "--write-hf", str(hf), "--device", device,
           *(["--small"] if shape is SMALL_SHAPE else [])]  # fmt: skip
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "timeout_s": timeout_s}
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        return {"status": "failed", "wall_s": wall_s, "reason": _tail(done.stderr)}
    return {
        "status": "ok",
        "wall_s": wall_s,
        "bytes": _dir_bytes(hf),
        "files": len(list(hf.glob("*.safetensors"))),
    }


def train_phase(args: list[str], run: Path, results: dict[str, Any], env: dict[str, str], timeout_s: float
                ) -> dict[str, Any]:  # fmt: skip
    """Phase 3: `gaudi3 train`, its summary's numbers and the estimate's error against the measured peak. A run
    stopped after its last step (in its final checkpoint, say) leaves no summary: its numbers then come from the
    last window of metrics.jsonl (`numbers_from`)."""
    train = run_cli(args, env, timeout_s)
    steps = results["model"]["shape"]["steps"]
    if train["status"] == "ok":
        numbers = json.loads((run / "summary.json").read_text())
        train["numbers_from"] = "summary.json"
    else:
        lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
        records = [r for r in map(json.loads, lines) if "step_time_s" in r]
        if not records or records[-1]["step"] < steps:
            return train
        numbers = {**records[-1], "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records)}
        train["numbers_from"] = (
            f"metrics.jsonl, steps {records[-1]['step'] - records[-1]['window_steps'] + 1}-{steps}"
        )
    keep = ("peak_memory_bytes", "step_time_s", "tokens_per_s", "mfu_peak_source", "measured_steps", "warmup_s",
            "wall_s", "train_loss", "predicted_peak_memory_bytes", "device", "precision")  # fmt: skip
    train.update({k: numbers[k] for k in keep if k in numbers})
    # MFU over this script's peak (as bench_gpu_shapes'); the run's own figure beside it (on a CPU the run
    # measures its own peak, so the two differ there).
    peak = results["peak_flops"]
    train["mfu"] = numbers["tokens_per_s"] * results["model"]["flops_per_token"] / peak if peak else None
    train["mfu_reported"] = numbers["mfu"]
    chosen = results["phases"]["estimate"]["chosen"]
    train["memory_error"] = _relative(chosen["estimate_bytes"], numbers["peak_memory_bytes"])
    train["checkpoint_bytes"] = _dir_bytes(run / "checkpoints") if chosen["save"] else None
    return train


def export_phase(run: Path, export: Path, parameters: int, env: dict[str, str], timeout_s: float
                 ) -> dict[str, Any]:  # fmt: skip
    """Phase 4: `gaudi3 ckpt export --format hf`; complete when its tensors hold the model's parameters."""
    exported = run_cli(["ckpt", "export", str(run), "--out", str(export), "--format", "hf"], env, timeout_s)
    if exported["status"] == "ok":
        exported["bytes"] = _dir_bytes(export)
        exported["parameters"] = export_tensors(export)
        exported["complete"] = exported["parameters"] == parameters
    return exported


def run_phases(shape: Shape, device: str, results: dict[str, Any], out: Path, budget_s: float,
               precisions: tuple[str, ...]) -> None:  # fmt: skip
    """estimate → write → train → export, each recorded in `results["phases"]` and written to `out` as it ends."""
    from gaudi3_scale.models import count_parameters, flops_per_token

    started = time.perf_counter()

    def left_s() -> float:
        return max(budget_s - (time.perf_counter() - started), 1.0)

    phases: dict[str, Any] = results.setdefault("phases", {})
    cfg = model_config(shape, device)
    results["model"] = {"preset": shape.preset, "parameters": count_parameters(cfg),
                        "flops_per_token": flops_per_token(cfg), "shape": asdict(shape)}  # fmt: skip
    phases["estimate"] = choose_layout(cfg, shape, device, *_memory_bytes(device), precisions=precisions)
    write_json_atomic(out, results)
    chosen = phases["estimate"]["chosen"]
    if chosen is None:
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    places = chosen["places"]
    work = {root: Path(tempfile.mkdtemp(prefix="gpu_llama8b-", dir=root)) for root in set(places.values())}
    hf, run, export = (work[places.get(k, places["hf"])] / k for k in ("hf", "checkpoint", "export"))
    try:
        phases["write"] = write_phase(shape, hf, device, env, left_s())
        write_json_atomic(out, results)
        if phases["write"]["status"] != "ok":
            return
        phases["train"] = train_phase(train_args(shape, chosen, hf, run, device), run, results, env, left_s())
        write_json_atomic(out, results)
        shutil.rmtree(hf)  # the run has read it; its room is the export's
        if phases["train"]["status"] != "ok":
            return
        if not chosen["save"]:
            phases["export"] = {
                "status": "skipped: the checkpoint and export would not fit the free disk space"
            }
        else:
            phases["export"] = export_phase(run, export, results["model"]["parameters"], env, left_s())
        write_json_atomic(out, results)
    finally:
        for directory in work.values():
            shutil.rmtree(directory, ignore_errors=True)


def verdict(results: dict[str, Any]) -> str:
    phases, name = results["phases"], results["model"]["preset"]
    chosen = phases["estimate"]["chosen"]
    if chosen is None:
        return f"{name}: no one-rank layout fits (see phases.estimate.candidates)"
    layout = (f"fsdp 1 rank, {chosen['precision']}, offload {chosen['offload']}, act.ckpt "
              f"{'on' if chosen['activation_checkpointing'] else 'off'}")  # fmt: skip
    failed = next((k for k in ("write", "train", "export") if phases.get(k, {}).get("status") != "ok"), None)
    measured = "peak_memory_bytes" in phases.get("train", {})  # also when stopped after the last step
    if failed == "write" or (failed == "train" and not measured):
        return f"{name} {layout}: {failed} {phases.get(failed, {}).get('status', 'not reached')}"
    train = phases["train"]
    err = train["memory_error"]
    fits = train["peak_memory_bytes"] <= phases["estimate"]["budget_bytes"] and abs(err) <= 0.10
    mfu = f"MFU {train['mfu']:.1%}" if train.get("mfu") is not None else "MFU unknown"
    export = phases.get("export", {})
    shipped = (f"export {'complete' if export.get('complete') else 'INCOMPLETE'} ({export['bytes'] / 1e9:.1f} GB)"
               if failed is None else f"export {export.get('status', 'not reached')}")  # fmt: skip
    if failed == "train":
        shipped = (
            f"the run {train['status']} after its last step (numbers from {train['numbers_from']}); {shipped}"
        )
    return (
        f"{name} {layout}: {'fits as predicted' if fits else 'NOT as predicted'} (peak "
        f"{train['peak_memory_bytes'] / _GIB:.1f} GiB, estimate {chosen['estimate_bytes'] / _GIB:.1f} GiB, "
        f"{err:+.1%}), {train['step_time_s']:.3f} s/step, {train['tokens_per_s']:,.0f} tok/s, {mfu}; {shipped}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--small", action="store_true", help="llama-tiny's shape (the default without CUDA)")
    parser.add_argument(
        "--budget-s", type=float, default=240.0, help="the phases stop after this long in all"
    )
    parser.add_argument("--out", type=Path, help="result JSON (default results/llama8b_<device>.json)")
    parser.add_argument(
        "--precisions", default=",".join(PRECISIONS),
        help="the train.precision values the layouts may use, comma-separated (default: %(default)s); "
        "--small --precisions bf16-true dry-runs the path the 8B takes on an H200",
    )  # fmt: skip
    parser.add_argument("--write-hf", type=Path, help=argparse.SUPPRESS)  # the worker of phase 2
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {device!r}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    if not precisions or set(precisions) - set(PRECISIONS):
        parser.error(f"--precisions must be some of {', '.join(PRECISIONS)}, got {args.precisions!r}")
    shape = SMALL_SHAPE if args.small or device == "cpu" else GPU_SHAPE
    if args.write_hf:
        write_hf(shape, args.write_hf, device)
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # cleans up the work dirs

    from gaudi3_scale.monitor.environment import environment_info

    out = args.out or RESULTS / f"llama8b_{_device_tag(device)}.json"
    partial = out.with_name(f"{out.stem}.partial.json")
    try:
        stored = load_stored_results(out, {})
    except ValueError as err:
        parser.error(str(err))
    peak, peak_source = _peak_flops(device)
    results: dict[str, Any] = {"benchmark": "gpu_llama8b", "machine": environment_info(), "device": device,
                               "budget_s": args.budget_s, "peak_flops": peak, "peak_source": peak_source}  # fmt: skip
    started = time.perf_counter()
    try:
        run_phases(shape, device, results, partial, args.budget_s, precisions)
    finally:
        results["wall_s"] = time.perf_counter() - started
        results["verdict"] = (
            verdict(results) if "estimate" in results.get("phases", {}) else "estimate not reached"
        )
        write_json_atomic(partial, results)
        # An interrupted or failed run never replaces a complete stored result: it stays, the partial file beside it.
        if complete(results) or not complete(stored):
            write_json_atomic(out, results)
            partial.unlink()
            written = out
        else:
            print(f"kept {out} (a complete result); this run did not complete: its phases are in {partial}",
                  file=sys.stderr)  # fmt: skip
            written = partial
    print(f"verdict: {results['verdict']}")
    print(f"wrote {written}")


def complete(results: dict[str, Any]) -> bool:
    """Whether every phase of a run (estimate, write, train, export) ended ok."""
    phases = results.get("phases") or {}
    estimate = phases.get("estimate") or {}
    return bool(estimate.get("chosen")) and all(
        (phases.get(k) or {}).get("status") == "ok" for k in ("write", "train", "export")
    )


if __name__ == "__main__":
    main()
