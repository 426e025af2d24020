"""`gaudi3 train` against a minimal plain-PyTorch loop on the same model code and batch, alternated in one run.

Each cell runs both sides in fresh processes, alternated (plain, gaudi3, plain, gaudi3, ...) so drift hits both:

  plain   build_model → AdamW (fused on CUDA) → bf16 autocast → loss = cross-entropy of the model's logits, the two
          in one torch.compile region when compiled → backward → clip 1.0 → step; uniformly random token batches
          from pinned host memory, copied non-blocking; TF32 on. What nanoGPT's train.py does, on our model code.
  gaudi3  `gaudi3 train` on `data.source synthetic` (uniformly random ids) with the same shape, batch, precision
          and compile setting, checkpoints and validation off; its summary.json (steady state, device-synchronised).

Both leave out the same warm-up steps and time the same measured steps after a device synchronise. MFU is
6N + 12·L·H·Q·T FLOPs per token (models/counting.py) over the device's dense BF16 peak (device/accelerators.yaml;
on CPU the measured fp32 matmul peak). Results go to JSON (device, library versions, every run) and a PNG.

    python benchmarks/bench_gpu.py                            # all cells of the device's set (GPU: the H100 set)
    python benchmarks/bench_gpu.py --cells gpt2-mb12-compiled  # some cells; results merge into the same JSON
    python benchmarks/bench_gpu.py --small                     # the tiny CPU set (the default without CUDA)
    python benchmarks/bench_gpu.py --list                      # the cells
    python benchmarks/bench_gpu.py --cells llama3.2-1b-fp8-compiled --loss-only  # fp8 vs bf16: loss, tokens/s
    python benchmarks/bench_gpu.py --cells gpt2-mb12-eager --profile 5  # where the two loops' steps differ
    python benchmarks/bench_gpu.py --ablation max-autotune  # one default-vs-variant pair (--ablation: all of them)

A device call on the lent GPU machine is limited to 10 minutes: run the GPU set a few cells at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
# gaudi3 train's default train.log_every_steps: both sides report per-window times at its steps.
LOG_EVERY_STEPS = 10
# The fp8 loss check's final validation: 20 batches of held-out windows (one batch is too noisy to set a 1 % goal on).
LOSS_VAL_BATCHES = 20


@dataclass(frozen=True, kw_only=True)
class Cell:
    name: str
    model: str  # registry preset
    model_overrides: dict[str, Any] = field(default_factory=dict)
    vocab_size: int  # the synthetic ids' range; the model's vocabulary
    context_length: int
    micro_batch_size: int
    precision: str  # a train.precision value
    compile: bool
    warmup_steps: int
    measured_steps: int
    loss_steps: int = 0  # > 0: also train this many steps on the bundled corpus and report the final loss
    # Knobs of the defaults under test (--ablation); None / True = the default each side picks by itself.
    pad_vocab_to_multiple: int | None = None  # both sides
    compile_mode: str = "default"  # both sides
    loss_in_compile: bool = (
        True  # plain loop only: False compiles the model alone, the loss runs eagerly after it
    )
    pin_memory: bool = True  # plain loop only: False copies batches from pageable memory
    fp8_recipe: str = "tensorwise"  # both sides, fp8 cells (train.fp8_recipe)
    fp8_head: bool = False  # both sides, fp8 cells (train.fp8_head)
    fp8_skip_small_linears: bool = False  # both sides, fp8 cells (train.fp8_skip_small_linears)
    activation_checkpointing: bool = False  # gaudi3 side only (parallel.activation_checkpointing)
    # gaudi3 side: the synthetic ids' range when it is not the model's vocabulary (BERT's MLM adds 4 special tokens)
    data_vocab_size: int | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.context_length


def _gpt2(mb: int, compile: bool) -> Cell:
    """nanoGPT's GPT-2 124M benchmark shape: bias off, context 1024, bf16 autocast."""
    mode = "compiled" if compile else "eager"
    return Cell(name=f"gpt2-mb{mb}-{mode}", model="gpt2-124m", model_overrides={"bias": False}, vocab_size=50257,
                context_length=1024, micro_batch_size=mb, precision="bf16-mixed", compile=compile,
                warmup_steps=5 if compile else 2, measured_steps=40)  # fmt: skip


def _llama(precision: str, size: str = "1b", micro_batch_size: int = 8) -> Cell:
    return Cell(name=f"llama3.2-{size}-{precision}-compiled", model=f"llama3.2-{size}", vocab_size=128256,
                context_length=2048, micro_batch_size=micro_batch_size, precision=precision, compile=True,
                warmup_steps=5, measured_steps=20, loss_steps=200)  # fmt: skip


# Llama 3.2 3B at micro-batch 2 (about 70 GB by tune.memory's estimate, bf16-mixed, no activation checkpointing):
# a wider model, where FP8 covers more of the FLOPs (its head is 11 % of them, the 1B's 19 %).
GPU_CELLS = [_gpt2(12, False), _gpt2(12, True), _gpt2(32, False), _gpt2(32, True), _llama("bf16-mixed"),
             _llama("fp8"), _llama("bf16-mixed", "3b", 2), _llama("fp8", "3b", 2)]  # fmt: skip


def _variant(base: Cell, label: str, **change: Any) -> Cell:
    return Cell(**{**asdict(base), **change, "name": f"{base.name} | {label}"})


# --ablation: each default against the same cell without it. (base, variant, the sides whose code has the knob)
GPU_ABLATION: list[tuple[Cell, Cell, tuple[str, ...]]] = [
    (_gpt2(32, True), _variant(_gpt2(32, True), "vocab not padded", pad_vocab_to_multiple=1), ("plain", "gaudi3")),
    (_gpt2(32, True), _variant(_gpt2(32, True), "loss outside compile", loss_in_compile=False), ("plain",)),
    (_gpt2(32, True), _variant(_gpt2(32, True), "pageable batches", pin_memory=False), ("plain",)),
    (_gpt2(12, True), _variant(_gpt2(12, True), "CUDA graphs", compile_mode="reduce-overhead"), ("plain", "gaudi3")),
    # Not a default: whether autotuned matmul templates would lift the 45 % MFU cell (a candidate for the tuner).
    (_gpt2(32, True), _variant(_gpt2(32, True), "max-autotune", compile_mode="max-autotune"), ("plain", "gaudi3")),
]  # fmt: skip
_TINY = {"arch": "gpt2", "num_layers": 2, "num_heads": 2, "dim": 64, "bias": False}
CPU_CELLS = [
    Cell(name="tiny-eager", model="shakespeare-char", model_overrides=_TINY, vocab_size=512, context_length=64,
         micro_batch_size=8, precision="32-true", compile=False, warmup_steps=2, measured_steps=200),
    Cell(name="tiny-compiled", model="shakespeare-char", model_overrides=_TINY, vocab_size=512, context_length=64,
         micro_batch_size=8, precision="32-true", compile=True, warmup_steps=5, measured_steps=200),
]  # fmt: skip
# On CPU the measured decision is the other way round: padding the vocabulary only adds work.
_CHAR = Cell(**{**asdict(CPU_CELLS[0]), "name": "char-eager", "vocab_size": 65})
CPU_ABLATION: list[tuple[Cell, Cell, tuple[str, ...]]] = [
    (_CHAR, _variant(_CHAR, "vocab padded to 64", pad_vocab_to_multiple=64), ("plain", "gaudi3")),
    (CPU_CELLS[1], _variant(CPU_CELLS[1], "loss outside compile", loss_in_compile=False), ("plain",)),
]


# ---- the plain loop (runs in a worker process: `bench_gpu.py --worker plain CELL_JSON`) ------------------------
def plain_loop(
    cell: Cell, device_name: str, trace: Path | None = None, profile_steps: int = 0
) -> dict[str, Any]:
    """`trace`: record `profile_steps` steps after the warm-up with the profiler `gaudi3 train` uses (its
    activities and one warm-up step before the window) and write them there as a Chrome trace."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from gaudi3_scale.models import build_model, get_model_config
    from gaudi3_scale.monitor.clock import DeviceClock

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    cfg = _model_config(cell, get_model_config).resolve_padding(device.type)
    torch.manual_seed(0)
    with device:
        model = build_model(cfg)
    if cell.precision == "fp8":
        from gaudi3_scale.device.float8 import apply_float8

        apply_float8(
            model, recipe=cell.fp8_recipe, head=cell.fp8_head, skip_small_linears=cell.fp8_skip_small_linears
        )
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=True)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    mode = None if cell.compile_mode == "default" else cell.compile_mode
    step_fn = loss_fn
    if cell.compile and cell.loss_in_compile:
        step_fn = torch.compile(loss_fn, mode=mode)
    elif cell.compile:
        compiled_model = torch.compile(model, mode=mode)

        def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = compiled_model(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    bf16 = cell.precision in ("bf16-mixed", "fp8")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cell.vocab_size, size=4_000_000, dtype=np.int64)  # like the synthetic source
    pin = device.type == "cuda" and cell.pin_memory

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = rng.integers(0, len(tokens) - cell.context_length - 1, size=cell.micro_batch_size)
        window = tokens[starts[:, None] + np.arange(cell.context_length + 1)]
        x, y = torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(window[:, 1:].copy())
        if pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    clock = DeviceClock(device)
    started = 0.0
    total = cell.warmup_steps + cell.measured_steps
    # (last step, its clock mark) where gaudi3 train writes a record: the per-window times beside its own
    marks: list[tuple[int, Any]] = []
    profiler = _plain_profiler(cell, device.type, profile_steps) if trace else None
    if profiler:
        profiler.__enter__()
    for step in range(total):
        if step == cell.warmup_steps:
            started = clock.now()
        x, y = batch()
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if profiler:
            profiler.step()
        done = step + 1
        if done > cell.warmup_steps and (done % LOG_EVERY_STEPS == 0 or done == total):
            marks.append((done, clock.mark()))  # a timing event on CUDA: no synchronise inside the loop
    step_time_s = (clock.now() - started) / cell.measured_steps
    windows: list[dict[str, float]] = []
    last_step, last_s = cell.warmup_steps, started
    for done, when in marks:
        reached = when()
        windows.append({"step": done, "ms_per_step": (reached - last_s) / (done - last_step) * 1e3})
        last_step, last_s = done, reached
    if profiler and trace:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(trace)
    return {"step_time_s": step_time_s, "final_loss": float(loss.detach()), "windows": windows}


def _plain_profiler(cell: Cell, device_type: str, steps: int) -> Any:
    """What `train.profile_start_step = warmup_steps` gives `gaudi3 train` (train/profile_callback.py)."""
    from gaudi3_scale.monitor.profiler import GaudiProfiler

    activities = ["cpu", *([device_type] if device_type in ("cuda", "hpu") else []), "memory"]
    return GaudiProfiler(
        activities, schedule_wait=cell.warmup_steps - 1, schedule_warmup=1, schedule_active=steps
    )


def _model_config(cell: Cell, get_model_config: Any) -> Any:
    from dataclasses import replace

    cfg = get_model_config(cell.model)
    return replace(cfg, **cell.model_overrides, vocab_size=cell.vocab_size, context_length=cell.context_length,
                   pad_vocab_to_multiple=cell.pad_vocab_to_multiple)  # fmt: skip


# ---- the gaudi3 side ---------------------------------------------------------------------------------------------
def gaudi3_overrides(
    cell: Cell, *, steps: int, warmup: int, source: str, val_batches: int = 1, seed: int | None = None
) -> list[str]:
    model = [f"--model.{k}={v}".lower() if isinstance(v, bool) else f"--model.{k}={v}"
             for k, v in cell.model_overrides.items()]  # fmt: skip
    return [
        f"--model.name={cell.model}", *model, f"--model.context_length={cell.context_length}",
        f"--model.vocab_size={cell.vocab_size}", f"--data.source={source}",
        f"--train.micro_batch_size={cell.micro_batch_size}", f"--train.global_batch_size={cell.micro_batch_size}",
        f"--train.precision={cell.precision}", f"--train.compile={str(cell.compile).lower()}",
        f"--train.max_steps={steps}", f"--train.throughput_warmup_steps={warmup}",
        "--train.val_every_steps=0", f"--train.val_batches={val_batches}", "--checkpoint.enabled=false",
        *([f"--seed={seed}"] if seed is not None else []),
        "--optim.lr=3e-4", "--optim.beta2=0.95", "--optim.grad_clip_norm=1.0",
        *([f"--model.pad_vocab_to_multiple={cell.pad_vocab_to_multiple}"] if cell.pad_vocab_to_multiple else []),
        *([f"--train.compile_mode={cell.compile_mode}"] if cell.compile_mode != "default" else []),
        *(["--parallel.activation_checkpointing=true"] if cell.activation_checkpointing else []),
        *([f"--train.fp8_recipe={cell.fp8_recipe}", f"--train.fp8_head={str(cell.fp8_head).lower()}",
           f"--train.fp8_skip_small_linears={str(cell.fp8_skip_small_linears).lower()}"]
          if cell.precision == "fp8" else []),
    ]  # fmt: skip


def run_gaudi3(
    cell: Cell, out: Path, env: dict[str, str], profile_steps: int = 0, timeout_s: float | None = None
) -> dict[str, Any]:
    """`profile_steps` > 0: also profile that many steps after the warm-up (trace in `out/profile/`); `timeout_s`:
    stop the run after that long (status "timeout")."""
    steps = cell.warmup_steps + cell.measured_steps
    profile = ([f"--train.profile_start_step={cell.warmup_steps}", f"--train.profile_num_steps={profile_steps}"]
               if profile_steps else [])  # fmt: skip
    args = ["train", "--out", str(out), "--resume", "never", "--no-progress", "--sample-tokens", "0", *profile,
            *gaudi3_overrides(cell, steps=steps, warmup=cell.warmup_steps, source=f"synthetic:{cell.data_vocab_size or cell.vocab_size}")]  # fmt: skip
    run = run_cli(args, env, timeout_s)
    if run["status"] != "ok":
        return run
    process_s = run["process_s"]
    summary = json.loads((out / "summary.json").read_text())
    # The raw per-window step times (the first window holds the warm-up steps too), to set beside the plain loop's:
    # is a difference spread over every window, or in one?
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [
        {"step": r["step"], "ms_per_step": r["step_time_s"] * 1e3} for r in records if "step_time_s" in r
    ]
    return {"status": "ok", "step_time_s": summary["step_time_s"], "measured_steps": summary["measured_steps"],
            "warmup_s": summary["warmup_s"], "final_loss": summary["train_loss"], "mfu_reported": summary["mfu"],
            "tokens_per_s": summary["tokens_per_s"], "peak_memory_bytes": summary["peak_memory_bytes"],
            "wall_s": summary["wall_s"], "process_s": process_s, "windows": windows}  # fmt: skip


def run_cli(args: list[str], env: dict[str, str], timeout_s: float | None) -> dict[str, Any]:
    """One `gaudi3 ARGS` call in a fresh process: status ok / failed / timeout, its wall time (`process_s`) and, when
    not ok, its last lines (`reason`)."""
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True,
                              env=env, timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        output = exc.stderr or exc.stdout or b""
        text = output.decode(errors="replace") if isinstance(output, bytes) else output
        return {"status": "timeout", "timeout_s": timeout_s, "reason": _tail(text)}
    process_s = time.perf_counter() - started
    if done.returncode != 0:
        return {"status": "failed", "process_s": process_s, "reason": _tail(done.stderr or done.stdout)}
    return {"status": "ok", "process_s": process_s}


def _tail(output: str) -> list[str]:
    """The last lines a failed run printed: what its JSON entry keeps of it."""
    return output.strip().splitlines()[-20:]


def run_plain(cell: Cell, device: str, env: dict[str, str], trace: Path | None = None, profile_steps: int = 0
              ) -> dict[str, Any]:  # fmt: skip
    cmd = [sys.executable, __file__, "--worker", "plain", json.dumps(asdict(cell)), "--device", device]
    if trace:
        cmd += ["--trace", str(trace), "--profile", str(profile_steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"status": "failed", "reason": _tail(done.stderr or done.stdout)}
    return {"status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}


# ---- measurement, ratios, output ---------------------------------------------------------------------------------
def _peak_flops(device: str) -> tuple[float | None, str]:
    import torch

    from gaudi3_scale.device.select import measure_cpu_matmul_flops
    from gaudi3_scale.device.specs import find_accelerator

    if device == "cpu":
        threads = torch.get_num_threads()
        return measure_cpu_matmul_flops(threads), f"measured fp32 matmul peak with {threads} threads"
    spec = find_accelerator(torch.cuda.get_device_name())
    if spec is None:
        return None, "unknown accelerator"
    return spec.bf16_dense_tflops * 1e12, f"{spec.name} dense BF16 peak: {spec.source}"


def summarize(cell: Cell, runs: dict[str, list[dict[str, Any]]], peak: float | None, *, peak_measured: bool = False
              ) -> dict[str, Any]:  # fmt: skip
    """Median step time per side, tokens/s, MFU and the ratio; `peak_measured`: the CPU's measured matmul peak."""
    from gaudi3_scale.models import flops_per_token, get_model_config
    from gaudi3_scale.monitor.perf import mfu_above_peak

    fpt = flops_per_token(_model_config(cell, get_model_config))
    out: dict[str, Any] = {"cell": asdict(cell), "flops_per_token": fpt, "runs": runs}
    for side in ("plain", "gaudi3"):
        ok = [r["step_time_s"] for r in runs[side] if r.get("status") == "ok"]
        if not ok:
            out[side] = None
            continue
        step = statistics.median(ok)
        tps = cell.tokens_per_step / step
        out[side] = {
            "ms_per_step": step * 1e3,
            "tokens_per_s": tps,
            "mfu": tps * fpt / peak if peak else None,
        }
        above = None if peak_measured else mfu_above_peak(out[side]["mfu"])
        if above:  # a measuring bug, not a result: kept in the JSON with the reason, never plotted as a speed
            out[side]["above_peak"] = above
            print(f"{cell.name} {side}: {above}")
    if out["plain"] and out["gaudi3"]:
        out["ratio_tokens_per_s"] = out["gaudi3"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in results["cells"].values() if c.get("plain") and c.get("gaudi3")
             and not (c["plain"].get("above_peak") or c["gaudi3"].get("above_peak"))]  # fmt: skip
    if not cells:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cells)), 4), dpi=110)
    xs = range(len(cells))
    for offset, side in ((-0.2, "plain"), (0.2, "gaudi3")):
        ax.bar([x + offset for x in xs], [c[side]["ms_per_step"] for c in cells], width=0.4, label=side)
    for x, c in zip(xs, cells, strict=True):
        ax.annotate(f"×{c['ratio_tokens_per_s']:.3f}", (x, max(c["plain"]["ms_per_step"], c["gaudi3"]["ms_per_step"])),
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(list(xs), [c["cell"]["name"] for c in cells], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms per optimizer step (median)")
    machine = results["machine"]
    device = (machine.get("cuda") or {}).get("device") or machine.get("cpu")
    ax.set_title(f"gaudi3 train vs a plain PyTorch loop — {device}  (×: tokens/s ratio)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    from gaudi3_scale.device.float8 import FLOAT8_RECIPES, SKIP_SMALL_RECIPES

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", choices=["plain"], help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("cell_json", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--small", action="store_true", help="the tiny CPU cell set (the default without CUDA)"
    )
    parser.add_argument("--cells", help="comma-separated cell names (default: the whole set)")
    parser.add_argument(
        "--repeats", type=positive_int, default=2, help="alternated plain/gaudi3 pairs per cell"
    )
    parser.add_argument("--measured-steps", type=positive_int, help="override every cell's measured steps")
    parser.add_argument("--no-loss", action="store_true", help="skip the 200-step loss runs of the fp8 cells")
    parser.add_argument(
        "--loss-only", action="store_true",
        help="only the fp8 cells' loss runs (bf16 and fp8, 200 steps each: final loss and tokens/s of both)",
    )  # fmt: skip
    parser.add_argument(
        "--loss-seeds", type=positive_int, default=1, metavar="N",
        help="the loss runs once per seed 0..N-1 for each precision: means, and bf16's seed spread as the noise band",
    )  # fmt: skip
    parser.add_argument(
        "--out",
        type=Path,
        help="result JSON (merged by cell; default results/gpu_<device>.json); --profile writes <out stem>_profile.json",
    )
    parser.add_argument("--list", action="store_true", help="print the cells and exit")
    parser.add_argument(
        "--fp8-recipe", choices=FLOAT8_RECIPES,
        help="the fp8 cells' torchao recipe (train.fp8_recipe; default tensorwise)",
    )  # fmt: skip
    parser.add_argument(
        "--fp8-head", action="store_true", help="the fp8 cells also convert the output head (train.fp8_head)"
    )
    parser.add_argument(
        "--fp8-skip-small", action="store_true",
        help="the fp8 cells keep in bf16 the linears torchao expects to be slower in fp8 (train.fp8_skip_small_linears)",
    )  # fmt: skip
    parser.add_argument(
        "--ablation", nargs="?", const="", metavar="LABELS",
        help="each accelerator default against the same cell without it; LABELS (comma-separated, e.g. "
        "max-autotune) runs only those pairs",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=int, default=0, metavar="STEPS",
        help="instead of timing: profile STEPS steps of each side after the warm-up and print and save where their "
        "steps differ (<out stem>_profile.json, merged by cell; default results/gpu_<device>_profile.json; see "
        "trace_diff.py)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        cell = Cell(**json.loads(args.cell_json))
        print(json.dumps(plain_loop(cell, args.device or "cpu", args.trace, args.profile)))
        return
    # `timeout` and batch schedulers stop a run with SIGTERM. As SystemExit it reaches the `subprocess.run` in flight,
    # which then kills its child: a training left running would share the device with whatever runs next.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from gaudi3_scale.bench.result import keep_good_entry, load_stored_results, write_json_atomic
    from gaudi3_scale.monitor.environment import environment_info

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cells = CPU_CELLS if args.small or device == "cpu" else GPU_CELLS
    if args.list:
        for c in cells:
            print(f"{c.name:32s} {c.model} mb {c.micro_batch_size} ctx {c.context_length} {c.precision} "
                  f"{'compiled' if c.compile else 'eager'}")  # fmt: skip
        return
    if args.cells:
        wanted = args.cells.split(",")
        unknown = sorted(set(wanted) - {c.name for c in cells})
        if unknown:
            parser.error(f"unknown cell(s) {', '.join(unknown)}; valid: {', '.join(c.name for c in cells)}")
        cells = [c for c in cells if c.name in wanted]
    if args.measured_steps is not None:
        cells = [Cell(**{**asdict(c), "measured_steps": args.measured_steps}) for c in cells]
    if args.fp8_recipe or args.fp8_head or args.fp8_skip_small:
        recipe = args.fp8_recipe or "tensorwise"
        if args.fp8_skip_small and recipe not in SKIP_SMALL_RECIPES:
            parser.error(f"--fp8-skip-small needs a recipe of {', '.join(SKIP_SMALL_RECIPES)}, not {recipe}")
        fp8 = {"fp8_recipe": recipe, "fp8_head": args.fp8_head, "fp8_skip_small_linears": args.fp8_skip_small}
        # Results merge by cell name: each variant keeps its own.
        suffix = (
            f"-{recipe}" + ("-head" if args.fp8_head else "") + ("-skip-small" if args.fp8_skip_small else "")
        )
        cells = [
            Cell(**{**asdict(c), **fp8, "name": c.name + suffix}) if c.precision == "fp8" else c
            for c in cells
        ]
    ablation = _ablation_pairs(CPU_ABLATION if args.small or device == "cpu" else GPU_ABLATION, args.ablation,
                               args.measured_steps, parser)  # fmt: skip
    if args.profile < 0 or (args.profile and any(args.profile > c.measured_steps for c in cells)):
        parser.error(f"--profile must be between 1 and each cell's measured steps, got {args.profile}")
    stem = f"gpu_{'cpu' if device == 'cpu' else 'cuda'}"
    out = args.out or RESULTS / f"{stem}.json"
    # A profile goes to its own file beside the results, never over them.
    profile_out = out.with_name(f"{out.stem}_profile.json")
    try:
        results = load_stored_results(out, {"cells": {}})
        profiles = load_stored_results(profile_out, {"cells": {}}) if args.profile else {}
    except ValueError as err:
        parser.error(str(err))
    # The top-level machine and peak are the last run's; each cell, ablation pair and loss check written below
    # carries the machine and peak it was measured with (`measured_with`), so merged files keep per-cell provenance.
    results.update(benchmark="bench_gpu", machine=environment_info())
    peak, peak_source = _peak_flops(device)
    results["peak_flops"], results["peak_source"] = peak, peak_source
    measured_with = {"machine": results["machine"], "peak_flops": peak, "peak_source": peak_source}
    failed: list[str] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
    with progress, tempfile.TemporaryDirectory() as tmp:
        measure = _Measure(device, env, Path(tmp), progress, args.repeats)
        if args.profile:
            measure.task = progress.add_task("profile", total=len(cells) * 2)
            profiles.update(benchmark="bench_gpu --profile", machine=results["machine"])
            for cell in cells:
                profile = {
                    **measure.profile(cell, args.profile),
                    "measured_with": {"machine": results["machine"]},
                }
                keep_good_entry(profiles["cells"], cell.name, profile, _profile_ok)
                if not _profile_ok(profile):
                    failed.append(cell.name)
                write_json_atomic(profile_out, profiles)
            print(f"wrote {profile_out}")
            _exit_if_failed(failed)
            return
        if args.ablation is not None and not args.loss_only:
            measure.task = progress.add_task(
                "ablation", total=sum(2 * len(sides) for *_, sides in ablation) * args.repeats
            )
            for base, variant, sides in ablation:
                pair = {**measure.ablation(base, variant, sides), "measured_with": measured_with}
                keep_good_entry(results.setdefault("ablation", {}), variant.name, pair, _ablation_ok)
                if not _ablation_ok(pair):
                    failed.append(variant.name)
                write_json_atomic(out, results)
        elif not args.loss_only:
            measure.task = progress.add_task("bench_gpu", total=len(cells) * args.repeats * 2)
            for cell in cells:
                runs = measure.runs(cell, ("plain", "gaudi3"))
                summary = {
                    **summarize(cell, runs, peak, peak_measured=device == "cpu"),
                    "measured_with": measured_with,
                }
                _print_cell(summary)
                stored = results["cells"].get(cell.name)
                if isinstance(stored, dict) and "loss_after_steps" in stored:
                    # measured apart (the loss check): a timing rerun (--no-loss) keeps it; a loss check next replaces it
                    summary.setdefault("loss_after_steps", stored["loss_after_steps"])
                # A failed cell never replaces a stored good one: that stays, the attempt is kept beside it.
                keep_good_entry(results["cells"], cell.name, summary, _cell_ok)
                if not _cell_ok(summary):
                    failed.append(cell.name)
                write_json_atomic(out, results)  # after every cell: a killed run keeps the rest
    if not args.no_loss and args.ablation is None:
        failed += _loss_check(cells, env, results, out, seeds=args.loss_seeds, measured_with=measured_with)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    _exit_if_failed(failed)


def _cell_ok(cell: dict[str, Any]) -> bool:
    return bool(cell.get("plain") and cell.get("gaudi3"))


def _profile_ok(profile: dict[str, Any]) -> bool:
    return "failed" not in profile


def _ablation_ok(pair: dict[str, Any]) -> bool:
    return not any(isinstance(side, dict) and "failed" in side for side in pair.values())


def _exit_if_failed(failed: list[str]) -> None:
    """A run with a failed cell ends non-zero (after writing what did run), so a script or a device call can
    tell."""
    if failed:
        print(f"bench_gpu.py: failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


class _Measure:
    """Runs cells side by side (alternated) and advances one progress bar."""

    def __init__(self, device: str, env: dict[str, str], tmp: Path, progress: Any, repeats: int) -> None:
        self.device, self.env, self.tmp, self.progress, self.repeats = device, env, tmp, progress, repeats
        self.task: Any = None

    def one(self, cell: Cell, side: str, i: int) -> dict[str, Any]:
        self.progress.update(self.task, description=f"{cell.name} #{i} {side}")
        if side == "plain":
            run = run_plain(cell, self.device, self.env)
        else:
            run = run_gaudi3(
                cell, self.tmp / f"{cell.name.replace(' | ', '-').replace(' ', '_')}-{i}", self.env
            )
        self.progress.advance(self.task)
        return run

    def profile(self, cell: Cell, steps: int) -> dict[str, Any]:
        """One profiled run per side; their per-step aggregates and the diff (trace_diff.py)."""
        from trace_diff import aggregate, compare, format_diff

        plain_trace = self.tmp / f"plain-{cell.name}.json"
        ours_dir = self.tmp / f"profile-{cell.name}"
        self.progress.update(self.task, description=f"{cell.name} plain (profiled)")
        runs = {"plain": run_plain(cell, self.device, self.env, plain_trace, steps)}
        self.progress.advance(self.task)
        self.progress.update(self.task, description=f"{cell.name} gaudi3 (profiled)")
        runs["gaudi3"] = run_gaudi3(cell, ours_dir, self.env, steps)
        self.progress.advance(self.task)
        if any(r.get("status") != "ok" for r in runs.values()):
            return {"failed": runs}
        from gaudi3_scale.train.profile_callback import trace_path

        ours_trace = trace_path(
            ours_dir, rank=0, start_step=cell.warmup_steps, end_step=cell.warmup_steps + steps
        )
        plain, ours = aggregate(plain_trace), aggregate(ours_trace)
        diff = compare(plain, ours)
        print(format_diff(cell.name, diff))
        top = {side: dict(sorted(agg["kernels"].items(), key=lambda kv: -kv[1]["us"])[:20])
               for side, agg in (("plain", plain), ("gaudi3", ours))}  # fmt: skip
        return {"profiled_steps": steps, "diff": diff, "top_kernels": top}

    def runs(self, cell: Cell, sides: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for i in range(self.repeats):
            for side in sides:
                runs[side].append(self.one(cell, side, i))
        return runs

    def ablation(self, base: Cell, variant: Cell, sides: tuple[str, ...]) -> dict[str, Any]:
        """Base and variant alternated on each side; the variant's step time over the default's."""
        out: dict[str, Any] = {"base": base.name}
        for side in sides:
            times: dict[str, list[float]] = {"base": [], "variant": []}
            for i in range(self.repeats):
                for key, cell in (("base", base), ("variant", variant)):
                    run = self.one(cell, side, i)
                    if run.get("status") == "ok":
                        times[key].append(run["step_time_s"])
            if times["base"] and times["variant"]:
                b, v = statistics.median(times["base"]), statistics.median(times["variant"])
                out[side] = {"default_ms_per_step": b * 1e3, "variant_ms_per_step": v * 1e3,
                             "variant_step_time_over_default": v / b}  # fmt: skip
                print(f"{variant.name:48s} {side:6s} default {b * 1e3:8.2f} ms  variant {v * 1e3:8.2f} ms  "
                      f"×{v / b:.3f}")  # fmt: skip
            else:
                out[side] = {"failed": times}
        return out


def _ablation_pairs(
    pairs: list[tuple[Cell, Cell, tuple[str, ...]]],
    labels: str | None,
    measured_steps: int | None,
    parser: Any,
) -> list[tuple[Cell, Cell, tuple[str, ...]]]:
    """The pairs `--ablation LABELS` asks for (all for no labels), with `--measured-steps` applied to both cells."""
    if labels is None:
        return []
    by_label = {variant.name.split(" | ", 1)[1]: (base, variant, sides) for base, variant, sides in pairs}
    wanted = [label.strip() for label in labels.split(",") if label.strip()] or list(by_label)
    unknown = [label for label in wanted if label not in by_label]
    if unknown:
        parser.error(f"unknown ablation(s) {', '.join(unknown)}; valid: {', '.join(by_label)}")
    chosen = [by_label[label] for label in wanted]
    if measured_steps:
        chosen = [(Cell(**{**asdict(b), "measured_steps": measured_steps}),
                   Cell(**{**asdict(v), "measured_steps": measured_steps}), sides) for b, v, sides in chosen]  # fmt: skip
    return chosen


def _print_cell(result: dict[str, Any]) -> None:
    name = result["cell"]["name"]
    plain, ours = result.get("plain"), result.get("gaudi3")
    if not plain or not ours:
        print(f"{name}: failed: {result['runs']}")
        return
    mfu = f"  MFU {ours['mfu']:.1%}" if ours.get("mfu") else ""
    print(f"{name:32s} plain {plain['ms_per_step']:8.2f} ms  gaudi3 {ours['ms_per_step']:8.2f} ms  "
          f"{ours['tokens_per_s']:12,.0f} tok/s{mfu}  ×{result['ratio_tokens_per_s']:.3f}")  # fmt: skip


def _loss_check(
    cells: list[Cell],
    env: dict[str, str],
    results: dict[str, Any],
    out: Path,
    *,
    seeds: int = 1,
    measured_with: dict[str, Any] | None = None,
) -> list[str]:
    """fp8 cells: `loss_steps` steps of gaudi3 train on the bundled corpus in fp8 and in bf16: final losses, and
    steady-state tokens/s of each (the runs one after the other, on the same shape).

    The train loss is the mean of the last logging window. At 200 steps a 1B model has seen the bundled corpus
    several times, so that loss also measures memorisation. The loss of the run's final validation, on
    `LOSS_VAL_BATCHES` batches of held-out windows that no run trained on, is recorded beside it (`val_loss`,
    `val_relative`). `relative` and `val_relative` are |fp8 − bf16| / bf16 (what the 1 % goal is checked on);
    `fp8_minus_bf16_relative` and `val_fp8_minus_bf16_relative` keep the sign (above zero: fp8's loss is higher).

    A check whose runs failed never replaces a stored check that did not (see `keep_good_entry`); the names of the
    cells whose check had a failed run are returned.

    With `seeds` > 1 each precision runs once per seed (`--seed`: initial weights and data order). The losses and
    speeds recorded are then the means over the seeds (each seed's under `per_seed`), and the bf16 runs' spread,
    (max − min) / mean, is the noise band a gap must clear (`bf16_seed_spread`, `bf16_val_seed_spread`).

    Each run keeps its directory (metrics.jsonl, summary.json, loss.png; no checkpoints) and its output
    (`train.log`) under `<out stem>_runs/<cell>-<precision>[-seed<N>]/`, replaced by the next bench: a run stopped
    by a time limit still shows how far it got and how long its steps took."""
    from gaudi3_scale.bench.result import keep_good_entry, write_json_atomic

    runs_dir = out.with_name(f"{out.stem}_runs")
    precisions = ("bf16-mixed", "fp8")
    failed: list[str] = []
    for cell in [c for c in cells if c.precision == "fp8" and c.loss_steps]:
        per_seed: dict[str, dict[str, list[Any]]] = {
            key: {p: [] for p in precisions}
            for key in ("train_loss", "val_loss", "tokens_per_s", "mfu", "peak_memory_bytes")
        }
        failures: dict[str, Any] = {}
        for seed in range(seeds):
            for precision in precisions:
                variant = Cell(**{**asdict(cell), "precision": precision})
                run_dir = runs_dir / (f"{cell.name}-{precision}" + (f"-seed{seed}" if seed else ""))
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.mkdir(parents=True)
                overrides = gaudi3_overrides(variant, steps=cell.loss_steps, warmup=5, source="tinyshakespeare",
                                             val_batches=LOSS_VAL_BATCHES, seed=seed if seeds > 1 else None)  # fmt: skip
                cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(run_dir / "run"),
                       "--resume", "never", "--no-progress", "--sample-tokens", "0", *overrides]  # fmt: skip
                log = run_dir / "train.log"
                start = time.perf_counter()
                with log.open("w") as sink:
                    done = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
                summary = (
                    json.loads((run_dir / "run" / "summary.json").read_text()) if done.returncode == 0 else {}
                )
                print(f"{cell.name} {precision} seed {seed}: {cell.loss_steps} steps, exit {done.returncode}, "
                      f"{time.perf_counter() - start:.0f} s ({log})")  # fmt: skip
                for key, values in per_seed.items():
                    values[precision].append(summary.get(key))
                if done.returncode != 0:
                    failures[precision if seeds == 1 else f"{precision} seed {seed}"] = _tail(log.read_text())
        mean = {key: {p: _mean(v[p]) for p in precisions} for key, v in per_seed.items()}
        losses, val_losses, speeds = mean["train_loss"], mean["val_loss"], mean["tokens_per_s"]
        signed = _relative_gap(losses["fp8"], losses["bf16-mixed"])
        val_signed = _relative_gap(val_losses["fp8"], val_losses["bf16-mixed"])
        relative, val_relative = _abs(signed), _abs(val_signed)
        speedup = speeds["fp8"] / speeds["bf16-mixed"] if speeds["fp8"] and speeds["bf16-mixed"] else None
        check = {
            "steps": cell.loss_steps,
            **losses,
            "relative": relative,
            "fp8_minus_bf16_relative": signed,
            "val_loss": val_losses,
            "val_relative": val_relative,
            "val_fp8_minus_bf16_relative": val_signed,
            "val_batches": LOSS_VAL_BATCHES,
            "tokens_per_s": speeds,
            "mfu": mean["mfu"],
            "peak_memory_bytes": mean["peak_memory_bytes"],
            "fp8_over_bf16_tokens_per_s": speedup,
            **(
                {
                    "seeds": seeds,
                    "per_seed": per_seed,
                    "bf16_seed_spread": _spread(per_seed["train_loss"]["bf16-mixed"]),
                    "bf16_val_seed_spread": _spread(per_seed["val_loss"]["bf16-mixed"]),
                }
                if seeds > 1
                else {}
            ),
            **({"failed": failures} if failures else {}),
            **({"measured_with": measured_with} if measured_with else {}),
        }
        stored = results["cells"].setdefault(cell.name, {"cell": asdict(cell)})
        keep_good_entry(stored, "loss_after_steps", check, lambda c: not c.get("failed"))
        if failures:
            failed.append(f"{cell.name} (loss check)")
        print(f"{cell.name}: loss after {cell.loss_steps} steps bf16 {losses['bf16-mixed']} fp8 {losses['fp8']} "
              f"(fp8 − bf16: {signed}); val loss bf16 {val_losses['bf16-mixed']} fp8 {val_losses['fp8']} (fp8 − bf16: "
              f"{val_signed}); tokens/s bf16 {speeds['bf16-mixed']} fp8 {speeds['fp8']} (×{speedup})"
              + (f"; bf16 seed spread {_spread(per_seed['val_loss']['bf16-mixed'])} (val)" if seeds > 1 else ""))  # fmt: skip
        write_json_atomic(out, results)
    return failed


def _mean(values: list[Any]) -> float | None:
    """The mean over the seeds, or None when any seed's run gave no value (failed, or stopped)."""
    return None if not values or any(v is None for v in values) else float(statistics.fmean(values))


def _relative_gap(fp8: float | None, bf16: float | None) -> float | None:
    """(fp8 − bf16) / bf16, signed: above zero when fp8's loss is the higher."""
    return (fp8 - bf16) / bf16 if bf16 and fp8 else None


def _abs(value: float | None) -> float | None:
    return None if value is None else abs(value)


def _spread(values: list[Any]) -> float | None:
    """(max − min) / mean over the seeds: how far two runs of one precision land apart."""
    mean = _mean(values)
    return (max(values) - min(values)) / mean if mean and len(values) > 1 else None


if __name__ == "__main__":
    main()
