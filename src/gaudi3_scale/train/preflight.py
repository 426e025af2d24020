"""What a run refuses before it trains, in one place: shared by `gaudi3 train`'s launcher (once, before it starts
the ranks: one line instead of one per rank) and `GaudiTrainer.fit` (every process, also without our launcher).

`check_run_inputs` runs before any data work; `resume_point` picks the checkpoint to resume from and refuses one
this run cannot continue (its model, global batch, dataset names and seed as configured, its layout, DeepSpeed
partitions, budget, spot price). The model fields the dataset resolves and the prepared data itself are compared
with the checkpoint later, in the trainer, once the dataset is open (`train.resume.check_resume_compatible` /
`check_resume_data`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gaudi3_scale.checkpoint.manager import LATEST_NAME, checkpoint_directory
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.files import check_output_dir
from gaudi3_scale.metering.live import check_cost_config, check_resume_spot_price
from gaudi3_scale.monitor.config import check_trackers
from gaudi3_scale.train.config import RunConfig, config_dict
from gaudi3_scale.train.resume import (
    check_resume_budget,
    check_resume_compatible,
    check_resume_layout,
    check_resume_strategy,
    is_sharded_checkpoint,
    local_resume_candidate,
    read_resume_meta,
    resume_checkpoint,
    saved_run_config,
)

__all__ = ["check_resume_config", "check_run_inputs", "resume_point"]


def check_run_inputs(cfg: RunConfig) -> None:
    """One line, exit 2, for: a model.init_from checkpoint that is incomplete or unreadable (every shard present,
    every tensor there with its config's shape; headers only), a checkpoint.remote_url that cannot be opened, an
    unknown instance or price (cost), a tracker whose package is missing (monitor), an --out that is a file (or
    whose checkpoints/ is) or that holds a user's files a run would overwrite."""
    check_output_dir("out_dir", cfg.output_dir / "checkpoints")  # a file there would fail only the first save
    _check_not_foreign(cfg.output_dir)
    if cfg.model.init_from is not None:
        from gaudi3_scale.models.pretrained import open_pretrained

        open_pretrained(cfg.model.init_from)
    if cfg.checkpoint.remote_url:
        from gaudi3_scale.checkpoint.remote import open_remote

        open_remote(cfg.checkpoint.remote_url)
    check_cost_config(cfg.cost)
    check_trackers(cfg.monitor)


# What a run writes there that would replace a file of the same name. A run's own directory is told by its lock
# (`.run.lock`, taken before anything is written), its metrics.jsonl or a gaudi3 checkpoint in checkpoints/: a bare
# `checkpoints/` folder is a common name in ML projects (another tool's weights), not a sign of a run of ours.
_RUN_WRITES = ("config.yaml", "summary.json", "loss.png", "tokenizer", "health")


def _is_run_directory(out_dir: Path) -> bool:
    ckpts = out_dir / "checkpoints"
    return (
        (out_dir / "metrics.jsonl").exists()
        or any(out_dir.glob(".run*.lock"))
        or (ckpts / LATEST_NAME).is_file()
        or any(path.is_dir() for path in ckpts.glob("step-*"))
    )


def _check_not_foreign(out_dir: Path) -> None:
    """Refuse an --out that holds files a run would overwrite (a project directory, `--out .` beside one's own
    config.yaml, with or without a checkpoints/ folder of another tool's) but no run; a new, empty or unrelated
    directory, and a run's own, pass."""
    if not out_dir.is_dir() or _is_run_directory(out_dir):
        return
    if clash := next((name for name in _RUN_WRITES if (out_dir / name).exists()), None):
        raise ConfigError(
            "out_dir",
            f"{str(out_dir)!r} holds {clash} but no gaudi3 run (no checkpoints/step-*, metrics.jsonl or .run.lock); "
            "a run would overwrite it: pass a new directory (a run's own to continue it)",
        )


def check_resume_config(cfg: RunConfig) -> None:
    """Refuse, with `check_resume_compatible`'s line, a resume whose local checkpoint was trained with another
    model, global batch, dataset or seed than `cfg` says, before anything opens the dataset (`gaudi3 train`'s
    forecast resolves the vocabulary from it: a resume refused later would have prepared and cached another dataset
    first). The checkpoint's files are not checked here: one that cannot be read passes, for `resume_point` to
    verify and name."""
    candidate = local_resume_candidate(cfg)
    if candidate is None:
        return
    try:
        saved_run_config(candidate)
    except Exception:  # damaged or unreadable: resume_point verifies it and says what is wrong
        return
    check_resume_compatible(candidate, config_dict(cfg), before_data=True)


def resume_point(
    cfg: RunConfig, *, warn: Callable[[str], None] | None = None, own_model: bool = True
) -> Path | None:
    """The checkpoint this run resumes from (`train.resume`), or None; refused with one line when it is a single
    file and `parallel` a pipeline, the checkpoint was trained with another model, global batch, dataset or seed
    (`own_model`: the registry model on the run's dataset; the fields the data resolves are compared later, in the
    trainer), its DeepSpeed layout does not match `parallel`, its run already spent
    `cost.budget_usd` (`BudgetExhaustedError`, exit 3) or the spot price is still above
    `cost.spot_pause_above_usd_per_hour` (`SpotPausedError`, exit 4: a paused run restarted by its launcher, or
    rerun by hand too early, trains nothing at that price)."""
    ckpt = resume_checkpoint(cfg, warn=warn)
    if ckpt is not None:
        config = config_dict(cfg)  # train.max_steps null while train.max_epochs awaits the data
        parallel = config["parallel"]
        check_resume_layout(ckpt, parallel)  # from the manifest: before the state is read
        # Both read the checkpoint's non-tensor state only: every rank and the launcher run this, and the full
        # load is the trainer's. With the run's own model, before the dataset is prepared (a refused resume builds
        # no cache); check_resume_compatible checks the strategy too.
        if own_model:
            check_resume_compatible(ckpt, config, before_data=True)
        else:
            check_resume_strategy(read_resume_meta(ckpt), parallel, sharded=is_sharded_checkpoint(ckpt))
        # The spend the run recorded after its checkpoint, on one node: across nodes only rank 0's has its
        # metrics.jsonl (node-local --out), and every node's launcher and ranks must refuse alike, or the others
        # wait for rank 0 until a timeout. Rank 0's meter resumes from it either way and stops at the first step.
        recorded = cfg.output_dir / "metrics.jsonl" if cfg.parallel.nnodes == 1 else None
        check_resume_budget(cfg.cost, ckpt, max_steps=config["train"]["max_steps"], metrics_path=recorded)
        check_resume_spot_price(cfg.cost, checkpoint_directory(ckpt).name, warn=warn)
    return ckpt
