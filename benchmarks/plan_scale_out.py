"""Scale-out on paper (issue #39, item 5; #40, item 4): `gaudi3 plan --machine h100|gaudi3 --nodes N` for the Llama 3
8B and 70B recipes (8, 16, 64 nodes) and 405B (16, 32, 64 nodes), and how each predicted step splits into compute,
exposed communication (pipeline point-to-point included) and the pipeline bubble.

Nothing here runs on those machines: it is the forecast model (`gaudi3_scale.forecast`) with catalog figures, each
with its source (peak FLOP/s, link bandwidths in `forecast/links.yaml`, prices), and the fallback MFU of each accelerator
(measured on one H100 for the H100; an assumption for Gaudi, not yet validated on Gaudi hardware). The recipes are
docs/llama3_recipe.md's: context 8,192, 1,024 sequences (8.4 M tokens) per step, bf16, FSDP with activation
checkpointing; 70B adds tensor parallel 2 inside a node; 405B runs tensor parallel 8 inside a node × pipeline
parallel 8 across nodes (1F1B, the Llama 3 split: one layer fewer on the first and last stage, as Meta split 126
layers over 16 stages, Dubey et al. 2024 §3.3.2) × FSDP over the rest (docs/llama3_405b.md). Days and dollars
are for 10¹² tokens.

    PYTHONPATH=src python benchmarks/plan_scale_out.py   # → benchmarks/results/plan_scale_out.json, .md, .png
                                                          #   and docs/img/plan_scale_out.png
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.config.atomic import write_text_atomic
from gaudi3_scale.device.specs import accelerator_named
from gaudi3_scale.distributed.schedule_math import balanced_split
from gaudi3_scale.forecast.run import forecast_config
from gaudi3_scale.monitor.environment import environment_info

TOKENS = 1e12
COMMON = ["--model.context_length", "8192", "--train.global_batch_size", "1024", "--train.max_steps", "1000",
          "--parallel.strategy", "fsdp", "--parallel.activation_checkpointing", "true"]  # fmt: skip
RECIPES: dict[str, list[str]] = {
    "llama3-8b": ["--model.name", "llama3-8b", "--train.micro_batch_size", "2", *COMMON],
    "llama3-70b": [
        "--model.name",
        "llama3-70b",
        "--train.micro_batch_size",
        "1",
        "--parallel.tp_size",
        "2",
        *COMMON,
    ],
    # TP 8 in a node × PP 8 across nodes (1F1B), the Llama 3 split of 126 layers: 15, 16 × 6, 15
    "llama3-405b": "--model.name llama3-405b --train.micro_batch_size 1 --parallel.tp_size 8 --parallel.pp_size 8 "
    f"--parallel.pp_schedule 1f1b --parallel.pp_split [{','.join(map(str, balanced_split(126, 8) or ()))}]".split()
    + COMMON,
}
MACHINES = {
    "h100": "aws/p5.48xlarge/us-east-1",
    "gaudi3": None,
}  # the catalog instance priced per node (Gaudi 3: none sourced)
NODES = {"llama3-8b": (8, 16, 64), "llama3-70b": (8, 16, 64), "llama3-405b": (16, 32, 64)}


def _row(recipe: str, machine: str, nodes: int) -> dict[str, Any]:
    overrides = list(RECIPES[recipe])
    if MACHINES[machine]:
        overrides += ["--cost.instance", MACHINES[machine]]
    _, forecast = forecast_config(None, overrides, machine=machine, nodes=nodes, warn=lambda line: None)
    plan = forecast.as_dict()
    step = {k: v["value"] for k, v in plan["step"].items()}
    tokens_per_s = plan["tokens_per_s"]["value"]
    days = TOKENS / tokens_per_s / 86400
    cost = plan["cost_usd"]["value"]  # nodes × the run's wall time × the price
    wall_h = plan["wall"]["wall_s"]["value"] / 3600
    usd_per_tokens = cost / wall_h * days * 24 if cost and wall_h else None  # the same rate over 10¹² tokens
    return {
        "model": recipe,
        "machine": machine,
        "nodes": nodes,
        "layout": plan["run"]["layout"],
        "compute_s": step["compute_s"],
        "communication_s": step["communication_s"],
        "bubble_s": step["bubble_s"],
        "step_time_s": step["step_time_s"],
        "tokens_per_s": tokens_per_s,
        "days_per_1e12_tokens": days,
        "usd_per_1e12_tokens": usd_per_tokens,
        "peak_memory_bytes": plan["memory"]["total_bytes"]["value"],
        "fits": plan["memory"]["total_bytes"]["value"] <= accelerator_named(machine).memory_gb * 1e9,
        "sources": {
            "compute": plan["step"]["compute_s"]["source"],
            "communication": plan["step"]["communication_s"]["source"],
            "bubble": plan["step"]["bubble_s"]["source"],
            "cost": plan["cost_usd"]["source"],
        },
    }


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | machine | nodes | accumulation | compute | exposed comm. | bubble | step | memory/device | "
        "days per 10¹² tokens | $ per 10¹² tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        comm = r["communication_s"]
        share = f" ({comm / r['step_time_s']:.0%})" if comm is not None else ""
        usd = f"{r['usd_per_1e12_tokens'] / 1e6:,.1f} M" if r["usd_per_1e12_tokens"] else "no sourced price"
        bubble = f"{r['bubble_s']:.1f} s" if r["bubble_s"] else "—"
        lines.append(
            f"| {r['model']} | {r['machine']} | {r['nodes']} | {r['layout']['accumulation']} | "
            f"{r['compute_s']:.1f} s | {comm:.1f} s{share} | {bubble} | {r['step_time_s']:.1f} s | "
            f"{r['peak_memory_bytes'] / 2**30:.1f} GiB{'' if r['fits'] else ' (does not fit)'} | "
            f"{r['days_per_1e12_tokens']:.1f} | {usd} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RECIPES), figsize=(16, 4), dpi=110)
    for ax, recipe in zip(axes, RECIPES, strict=True):
        mine = [r for r in rows if r["model"] == recipe]
        labels = [f"{r['machine']}\n{r['nodes']} nodes" for r in mine]
        steps = [r["step_time_s"] for r in mine]
        compute = [100 * r["compute_s"] / step for r, step in zip(mine, steps, strict=True)]
        comm = [100 * (r["communication_s"] or 0.0) / step for r, step in zip(mine, steps, strict=True)]
        ax.bar(labels, compute, label="compute")
        ax.bar(labels, comm, bottom=compute, label="exposed communication")
        bubble = [100 * (r["bubble_s"] or 0.0) / step for r, step in zip(mine, steps, strict=True)]
        below = [c + m for c, m in zip(compute, comm, strict=True)]
        ax.bar(labels, bubble, bottom=below, label="pipeline bubble")
        for x, step in enumerate(steps):
            ax.text(x, 101, f"{step:.3g} s", ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, 112)
        ax.set_ylabel("share of the predicted step (%)")
        ax.set_title(f"{recipe}: 8.4 M tokens per step (step time above each bar)", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "gaudi3 plan on paper: where a step's time goes (catalog figures, not measured)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "plan_scale_out.json"
DOCS_IMAGE = ROOT / "docs" / "img" / "plan_scale_out.png"  # docs/foresight.md shows it


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON (.md and .png beside it)")
    parser.add_argument("--docs-image", help="also copy the plot here (empty: do not; default: docs/img/"
                        "plan_scale_out.png when --out is the default, else nothing)")  # fmt: skip
    args = parser.parse_args()
    # A trial run with its own --out never replaces the image the docs show.
    if args.docs_image is None:
        docs_image = DOCS_IMAGE if args.out.resolve() == DEFAULT_OUT else None
    else:
        docs_image = Path(args.docs_image) if args.docs_image else None
    rows = [
        _row(recipe, machine, nodes) for recipe in RECIPES for machine in MACHINES for nodes in NODES[recipe]
    ]
    result = {
        "benchmark": "plan_scale_out",
        "command": "PYTHONPATH=src python benchmarks/plan_scale_out.py " + " ".join(sys.argv[1:]),
        "machine": environment_info(),
        "note": "forecasts from catalog figures, not measurements",
        "rows": rows,
    }
    write_json_atomic(args.out, result)
    table = _markdown(rows)
    write_text_atomic(args.out.with_suffix(".md"), table)
    _plot(rows, args.out.with_suffix(".png"))
    if docs_image:
        docs_image.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.out.with_suffix(".png"), docs_image)
    print(table)
    copied = f" (plot copied to {docs_image})" if docs_image else ""
    print(f"wrote {args.out}, {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}{copied}")


if __name__ == "__main__":
    main()
