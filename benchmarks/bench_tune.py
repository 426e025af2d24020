"""The tuner against an exhaustive grid and against Lightning's batch-size finder, on this machine, in one run.

1. **Grid**: every configuration of the space (shakespeare-char, global batch 12 sequences = the default run's,
   1 rank: micro-batch {1,2,3,4,6,12} × activation checkpointing × torch.compile × threads per rank {2,1} = 48)
   runs as a real trial (the tuner's own trial runner: `gaudi3 train` subprocesses, warm-up excluded).
2. **Tuner**: `gaudi3 tune` over the same space from an empty cache; its wall time against the grid's.
3. **Lightning**: `Tuner(trainer).scale_batch_size(mode="power")` on the same model in a subprocess whose address
   space is capped so that the same memory budget makes allocations fail (Lightning recognises CPU OOM by the
   allocator's message); its pick trains with no accumulation (Lightning's finder knows none).
4. **Side by side**: the grid's best, the tuner's winner, the untuned default (micro-batch 12, 2 threads, no
   compile) and Lightning's pick, each re-measured `--repeats` times alternately; ratios from those medians.

    python benchmarks/bench_tune.py    # writes benchmarks/results/tune_cpu.json and tune_cpu.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import track

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.config.core import save_yaml
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.tune.config import TuneConfig
from gaudi3_scale.tune.space import Candidate, build_space
from gaudi3_scale.tune.trial import TrialResult, TrialSettings, run_trial
from gaudi3_scale.tune.tuner import run_tuner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

RESULTS = Path(__file__).parent / "results"
BUDGET_BYTES = 4 * 2**30

LIGHTNING_CHILD = r"""
import json, os, resource, sys
import psutil, torch
import lightning.pytorch as pl
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, Dataset
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.models import build_model

budget = int(sys.argv[1])
cfg = build_run_config(None, [("model.vocab_size", "65")])
context = cfg.model.context_length
torch.set_num_threads(2)

class Windows(Dataset):
    def __init__(self, n): self.g = torch.Generator().manual_seed(0); self.n = n
    def __len__(self): return self.n
    def __getitem__(self, i):
        x = torch.randint(0, 65, (context + 1,), generator=self.g)
        return x[:-1], x[1:]

class LM(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.batch_size = 1; self.model = build_model(cfg.model)
    def training_step(self, batch, _):
        x, y = batch
        logits = self.model(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    def configure_optimizers(self): return torch.optim.AdamW(self.parameters(), lr=1e-3)
    def train_dataloader(self): return DataLoader(Windows(100_000), batch_size=self.batch_size)

# Cap the address space so that an RSS of `budget` is where allocations start to fail.
proc = psutil.Process()
headroom = budget - proc.memory_info().rss
resource.setrlimit(resource.RLIMIT_AS, (proc.memory_info().vms + headroom, resource.RLIM_INFINITY))
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
found = Tuner(trainer).scale_batch_size(LM(), mode="power", init_val=1, steps_per_trial=3, max_trials=25)
print("LIGHTNING_PICK", json.dumps({"batch_size": found}))
"""


def _lightning_pick(budget: int) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", LIGHTNING_CHILD, str(budget)], capture_output=True, text=True, timeout=1800
    )
    for line in proc.stdout.splitlines():
        if line.startswith("LIGHTNING_PICK"):
            return int(json.loads(line.split(" ", 1)[1])["batch_size"])
    raise RuntimeError(f"Lightning's finder failed: {proc.stdout[-1500:]} {proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--measure-steps", type=positive_int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="side-by-side re-measurements of the finalists"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "tune_cpu.json")
    args = parser.parse_args()
    console = Console(stderr=True)
    base = build_run_config(None, [])  # the default run: shakespeare-char, global batch 12
    space = build_space(base, world_size=1, precisions=("32-true",))
    work = Path(tempfile.mkdtemp(prefix="bench-tune-"))
    save_yaml(base, work / "base.yaml")
    settings = TrialSettings(
        world_size=1, device="cpu", warmup_steps=args.warmup_steps, measure_steps=args.measure_steps,
        memory_budget_bytes=BUDGET_BYTES,
    )  # fmt: skip
    tokens = base.train.global_batch_size * base.model.context_length

    def trial(c: Candidate, tag: str) -> TrialResult:
        return run_trial(work / "base.yaml", c, settings, work / tag / c.key, tokens_per_step=tokens)

    # 1. the grid
    started = time.perf_counter()
    grid = [trial(c, "grid") for c in track(space.candidates(), description="grid", console=console)]
    grid_wall_s = time.perf_counter() - started
    ok = [r for r in grid if r.status == "ok"]
    grid_best = max(ok, key=lambda r: r.tokens_per_s or 0.0)
    # 2. the tuner, same space and trial settings, empty cache
    config = TuneConfig(
        memory_budget_bytes=BUDGET_BYTES, warmup_steps=args.warmup_steps, measure_steps=args.measure_steps
    )
    tuned = run_tuner(base, space, config, work / "tune", console=console)
    assert tuned.best is not None
    # 3. Lightning's pick
    pick = _lightning_pick(BUDGET_BYTES)
    default = Candidate(strategy="auto", precision="32-true", global_batch_size=12, micro_batch_size=12,
                        activation_checkpointing=False, compile=False, threads=space.threads[0])  # fmt: skip
    lightning = replace(default, global_batch_size=pick, micro_batch_size=pick)
    # 4. side by side
    finalists = {
        "grid_best": grid_best.candidate,
        "tuner": tuned.best.candidate,
        "default": default,
        "lightning_pick": lightning,
    }
    measured: dict[str, list[float]] = {name: [] for name in finalists}
    for i in track(range(args.repeats), description="side by side", console=console):
        for name, c in finalists.items():
            tok = c.global_batch_size * base.model.context_length
            r = run_trial(work / "base.yaml", c, settings, work / f"final-{i}" / name, tokens_per_step=tok)
            measured[name].append(r.tokens_per_s or 0.0)
    med = {name: statistics.median(v) for name, v in measured.items()}
    result: dict[str, Any] = {
        "benchmark": "tune",
        "command": "python benchmarks/bench_tune.py",
        "space": space.describe(),
        "grid_size": len(grid),
        "memory_budget_bytes": BUDGET_BYTES,
        "trial": {"warmup_steps": args.warmup_steps, "measure_steps": args.measure_steps},
        "grid_wall_s": grid_wall_s,
        "tuner_wall_s": tuned.outcome.wall_s,
        "tuner_trials": tuned.outcome.trials_run,
        "tuner_wall_over_grid": tuned.outcome.wall_s / grid_wall_s,
        "tuner_limit": tuned.outcome.limit,
        "grid_best": grid_best.candidate.label(1),
        "tuner_best": tuned.best.candidate.label(1),
        "lightning_pick_batch_size": pick,
        "finalists": {name: c.label(1) for name, c in finalists.items()},
        "tokens_per_s_side_by_side": measured,
        "tokens_per_s_median": med,
        "tuner_over_grid_best": med["tuner"] / med["grid_best"],
        "tuner_over_lightning_pick": med["tuner"] / med["lightning_pick"],
        "tuner_over_default": med["tuner"] / med["default"],
        "grid_trials": [r.to_dict() for r in grid],
        "tuner_trial_keys": [r.key for r in tuned.outcome.results if r.ran],
        "environment": environment_info(),
    }
    write_json_atomic(args.out, result)
    _plot(result, grid, {r.key for r in tuned.outcome.results if r.ran}, args.out.with_suffix(".png"))
    console.print(
        f"grid best {grid_best.candidate.label(1)}; tuner {tuned.best.candidate.label(1)} "
        f"({tuned.outcome.trials_run} trials); tuner/grid tokens/s {result['tuner_over_grid_best']:.3f}, "
        f"wall {result['tuner_wall_over_grid']:.3f}; tuner/Lightning pick (batch {pick}) "
        f"{result['tuner_over_lightning_pick']:.3f}; tuner/default {result['tuner_over_default']:.3f}"
    )


def _plot(result: dict[str, Any], grid: list[TrialResult], tuner_keys: set[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(grid, key=lambda r: r.tokens_per_s or 0.0)
    fig, ax = plt.subplots(figsize=(9, 10))
    colors = ["tab:orange" if r.key in tuner_keys else "tab:gray" for r in rows]
    ax.barh([r.candidate.label(1) for r in rows], [r.tokens_per_s or 0.0 for r in rows], color=colors)
    ax.set_xlabel("tokens/s (grid trial)")
    ax.set_title(
        f"{result['grid_size']}-config grid; orange = configs the tuner ran "
        f"({result['tuner_trials']} trials, {result['tuner_wall_over_grid']:.0%} of the grid's wall time)"
    )
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
