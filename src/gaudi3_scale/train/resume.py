"""What a run resumes from (`train.resume`: auto, never or a path), and what refuses a resume: another model shape,
global batch or dataset, other tokens than the checkpoint was trained on, or DeepSpeed partitions for another stage
or world size. One line each, before training."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gaudi3_scale.checkpoint.contents import (
    COST_KEY,
    OPTIMIZER_STATES_KEY,
    is_light,
    run_config,
    trained_data_sha256,
    zero_layout,
)
from gaudi3_scale.checkpoint.manager import (
    CheckpointManager,
    checkpoint_directory,
    resolve_checkpoint,
    state_path,
)
from gaudi3_scale.checkpoint.manifest import has_manifest, manifest_layout, read_manifest, verify_checkpoint
from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data.inputs import MIXTURE_SHA256_PREFIX
from gaudi3_scale.distributed.env import inside_launched_worker
from gaudi3_scale.distributed.plan import ZERO_STAGES
from gaudi3_scale.metering.config import CostConfig
from gaudi3_scale.metering.live import check_budget_left, resumed_cost_usd
from gaudi3_scale.models import ModelConfig
from gaudi3_scale.models.semantics import changes_missing_from
from gaudi3_scale.train.config import RunConfig

__all__ = [
    "check_resume_budget",
    "check_resume_compatible",
    "check_resume_data",
    "check_resume_layout",
    "check_resume_semantics",
    "check_resume_strategy",
    "is_sharded_checkpoint",
    "local_resume_candidate",
    "read_resume_meta",
    "resume_checkpoint",
    "resume_manifest",
    "saved_run_config",
]


def check_resume_budget(
    cost: CostConfig, checkpoint: Path, *, max_steps: int | None, metrics_path: Path | None
) -> None:
    """Refuse to resume a checkpoint when what the run spent already reached `cost.budget_usd` (exit 3, one line).

    The spend is the larger of the checkpoint's accrued cost, read from its manifest (the checkpoint's own
    `gaudi3_meta`, copied there at commit), and the last one the run recorded in `metrics_path`, its own
    metrics.jsonl (`resumed_cost_usd`; None: the checkpoint's alone): this costs no checkpoint load and runs before
    any rank is launched. A checkpoint already at `max_steps` passes whatever it cost: the run trains nothing, so it
    spends nothing, and a rerun of a finished run must not fail over money. `max_steps` None (a length in epochs,
    resolved once the data is open): the steps the checkpoint's own run resolved, from its saved config.
    """
    if cost.budget_usd is None:
        return
    directory = checkpoint_directory(checkpoint)
    manifest = read_manifest(directory) or {}
    stored, step = manifest.get(COST_KEY), manifest.get("step")
    if max_steps is None and isinstance(step, int):
        saved = (saved_run_config(checkpoint) or {}).get("train")
        resolved = saved.get("max_steps") if isinstance(saved, dict) else None
        max_steps = resolved if isinstance(resolved, int) else None
    if isinstance(step, int) and max_steps is not None and step >= max_steps:
        return
    checkpoint_usd = float(stored) if stored is not None else None
    spent = resumed_cost_usd(checkpoint_usd, metrics_path)
    if spent is None:
        return
    name = directory.name
    if checkpoint_usd is None or spent > checkpoint_usd:
        name += f" and the steps after it ({metrics_path})"
    check_budget_left(cost.budget_usd, spent, name)


def resume_manifest(cfg: RunConfig) -> dict[str, Any] | None:
    """The manifest of the checkpoint `train.resume` will most likely take (its `step`, accrued `cost_usd` …),
    read without checking the checkpoint's files: `local_resume_candidate`'s, else (nothing local) the one
    `checkpoint.remote_url` would give. None for a fresh start (`never`, nothing saved yet). For what a run predicts
    of itself before it starts (`gaudi3 train`'s forecast), never for what it resumes: that is `resume_checkpoint`,
    which verifies, may skip to an older one, and downloads the remote copy."""
    if (found := local_resume_candidate(cfg)) is not None:
        return read_manifest(found)
    if cfg.train.resume == "auto" and cfg.checkpoint.remote_url:
        from gaudi3_scale.checkpoint.storage import remote_manifest

        return remote_manifest(cfg.checkpoint.remote_url)
    return None


def local_resume_candidate(cfg: RunConfig) -> Path | None:
    """The local checkpoint directory `train.resume` will most likely take, its files unchecked: `auto`'s `latest`
    pointer target, else its newest committed checkpoint; a named checkpoint or run directory's own. None for a
    fresh start, or nothing committed here."""
    resume = cfg.train.resume
    if resume == "never":
        return None
    if resume == "auto":
        directory = cfg.output_dir / "checkpoints"
    else:
        directory = checkpoint_directory(resume)
        if not directory.is_dir():
            return None
        if read_manifest(directory) is not None:
            return directory
        directory = directory / "checkpoints" if (directory / "checkpoints").is_dir() else directory
    candidates = CheckpointManager(directory).resume_order()
    return next((path for path in candidates if read_manifest(path) is not None), None)


def read_resume_meta(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's state without reading its tensors (a sharded one's non-tensor state, a single file's memory
    map): what the resume checks compare, cheap at any model size. Not verified: `resume_checkpoint` did."""
    return read_checkpoint(checkpoint, mmap=True, verify=False, tensors=False)


def saved_run_config(checkpoint: Path) -> dict[str, Any] | None:
    """The resolved run config a checkpoint was trained with (None for checkpoints that predate storing it)."""
    return run_config(read_resume_meta(checkpoint))


# The model fields' defaults: a field added after a checkpoint was saved held its default there (a new field keeps
# what older versions did: num_experts None is dense, init_from None trains from scratch).
_MODEL_DEFAULTS = {
    field.name: field.default
    for field in dataclasses.fields(ModelConfig)
    if field.default is not dataclasses.MISSING
}


# The model fields a run resolves from its dataset (the tokenizer's vocabulary, the device's padding): a config
# compared before the data is opened leaves them null.
_RESOLVED_FROM_DATA = ("vocab_size", "pad_vocab_to_multiple")


def check_resume_compatible(
    checkpoint: Path, config: dict[str, Any], *, before_data: bool = False
) -> int | None:
    """Refuse to resume a checkpoint trained with another model shape, global batch, dataset or seed, or past the
    config's `train.max_steps` (one line); the checkpoint's step. `before_data`: `config` is the run's as given,
    before its dataset is opened (`train.preflight.resume_point`: a refused resume prepares no data), so the model
    fields the data resolves are compared only where the config sets them; the trainer compares them all later."""
    ckpt = read_resume_meta(checkpoint)
    check_resume_strategy(ckpt, config.get("parallel", {}), sharded=is_sharded_checkpoint(checkpoint))
    step, max_steps = ckpt.get("global_step"), config.get("train", {}).get("max_steps")
    if isinstance(step, int) and isinstance(max_steps, int) and max_steps < step:
        # state.ckpt: named by its step directory
        name = (checkpoint.parent if checkpoint.is_file() else checkpoint).name
        raise UserInputError(
            f"train.max_steps: {max_steps}, but the checkpoint {name} is at step {step}; allowed: {step} "
            "(nothing left to train) or more, or a new --out directory"
        )
    saved = run_config(ckpt)
    if saved is None:
        return step if isinstance(step, int) else None
    if saved.get("seed") != config.get(
        "seed"
    ):  # the data order's: the sampler would refuse it inside the fit
        raise UserInputError(
            f"seed: the checkpoint was trained with {saved.get('seed')!r} but the config says {config.get('seed')!r}; "
            "use the original value or a new --out directory"
        )
    # data.mixture replaces data.source (left at its default): which members, and their data, `check_resume_data`
    # compares once the data is open, and the mixture sampler's state the weights.
    mixture = saved.get("data", {}).get("mixture") or config.get("data", {}).get("mixture")
    for section, keys in (
        ("model", None),
        ("train", ("global_batch_size",)),
        ("data", ("tokenizer",) if mixture else ("source", "tokenizer")),
    ):
        old, new = saved.get(section, {}), config.get(section, {})
        for key in keys or sorted(set(old) | set(new)):
            if (
                key not in old
                and section == "model"
                and key in _MODEL_DEFAULTS
                and new.get(key) == _MODEL_DEFAULTS[key]
            ):
                continue  # a field added since the checkpoint was saved, at its default (what the run trained with)
            if before_data and section == "model" and key in _RESOLVED_FROM_DATA and new.get(key) is None:
                continue
            if old.get(key) != new.get(key):
                was = repr(old.get(key)) if key in old else "no such field (an older gaudi3-scale)"
                raise UserInputError(
                    f"{section}.{key}: the checkpoint was trained with {was} but the config says "
                    f"{new.get(key)!r}; use the original value or a new --out directory"
                )
    return step if isinstance(step, int) else None


def check_resume_semantics(checkpoint: Path, warn: Callable[[str], None]) -> None:
    """Say which changes to what the model computes (`models.semantics`) the checkpoint's run did not have, where
    they make a difference to its model: the resume continues on the objective this version computes, and its
    logged loss may step there. Checkpoints that predate storing the run config pass in silence."""
    saved = saved_run_config(checkpoint)
    manifest = read_manifest(checkpoint_directory(checkpoint))
    if saved is None or manifest is None:
        return
    name = checkpoint_directory(checkpoint).name
    for change in changes_missing_from(manifest, saved.get("model") or {}):
        warn(
            f"the checkpoint {name} was written before {change.since}, when {change.what} came in: "
            f"{change.effect(saved.get('model') or {})}"
        )


def check_resume_data(
    checkpoint: Path,
    data_sha256: str | None,
    *,
    allow_change: bool = False,
    warn: Callable[[str], None] | None = None,
) -> None:
    """Refuse to resume on tokens other than the checkpoint's (its manifest's `data_sha256`), unless allowed.

    The dataset's name and tokenizer may be unchanged while its content is not (the source text edited, the cache
    rebuilt): continuing would silently train the old run on new data. Checkpoints that predate the record pass.
    """
    saved = trained_data_sha256(read_manifest(checkpoint_directory(checkpoint)))
    if saved is None or data_sha256 is None or saved == data_sha256:
        return
    what = f"other tokens than the checkpoint {checkpoint_directory(checkpoint).name} was trained on"
    if allow_change:
        if warn is not None:
            warn(
                f"resuming on {what} (train.allow_data_change): at the checkpoint's data step, in the new data's order"
            )
        return
    mixture_now, mixture_then = (
        data_sha256.startswith(MIXTURE_SHA256_PREFIX),
        saved.startswith(MIXTURE_SHA256_PREFIX) or _trained_on_a_mixture(checkpoint),
    )
    if mixture_now and mixture_then and not saved.startswith(MIXTURE_SHA256_PREFIX):
        # a mixture's identity written before it had its own form (gaudi3-scale before 2026-11-30): not comparable
        # with today's, so the members' tokens go unchecked; the mixture sampler's state still checks the weights
        if warn is not None:
            warn(
                f"the checkpoint {checkpoint_directory(checkpoint).name} records its mixture's data in an older form: "
                "the members' tokens are not compared on this resume"
            )
        return
    if mixture_now or mixture_then:
        raise ConfigError("data.mixture", _mixture_change(what, mixture_now, mixture_then))
    raise ConfigError(
        "data.source",
        f"the prepared data now holds {what} (tokens SHA-256 {data_sha256[:12]}…, the checkpoint's "
        f"{saved[:12]}…): its source changed since; restore the original data, pass --train.allow_data_change true "
        "to continue on the new data, or use a new --out directory",
    )


def _trained_on_a_mixture(checkpoint: Path) -> bool:
    """Whether the checkpoint's own run config trained on a data.mixture (what its data identity cannot say when
    it predates the mixtures' own form)."""
    saved = saved_run_config(checkpoint) or {}
    return bool((saved.get("data") or {}).get("mixture"))


def _mixture_change(what: str, mixture_now: bool, mixture_then: bool) -> str:
    """What a changed data identity means when a mixture is involved (its weights and order are not part of it:
    the mixture sampler's state checks those)."""
    if not mixture_then:
        return (
            "the checkpoint was trained on one dataset (data.source), not a mixture; resume without data.mixture, "
            "or use a new --out directory"
        )
    if not mixture_now:
        return "the checkpoint was trained on a data.mixture; resume with the same data.mixture, or use a new --out directory"
    return (
        f"the mixture now holds {what}: a member was added, removed or renamed, or a member's data changed since; "
        "resume with the original members and data, pass --train.allow_data_change true to continue on a member's "
        "changed data (the members must stay the same), or use a new --out directory"
    )


def is_sharded_checkpoint(checkpoint: Path) -> bool:
    """Whether a committed checkpoint's manifest says it is sharded (DCP): its non-tensor state (`read_resume_meta`) then
    holds no optimizer state, though its shards do."""
    manifest = read_manifest(checkpoint_directory(checkpoint))
    return manifest is not None and manifest_layout(manifest) == "sharded"


def check_resume_strategy(ckpt: dict[str, Any], parallel: dict[str, Any], *, sharded: bool = False) -> None:
    """DeepSpeed optimizer partitions resume only under the same ZeRO stage and world size (for now); a ZeRO
    strategy resumes no other optimizer state (`ckpt`'s, or a `sharded` checkpoint's shards). `ckpt` is the
    checkpoint's non-tensor state (`read_resume_meta`): no tensor is read here."""
    strategy = parallel.get("strategy")
    world = int(parallel.get("nproc_per_node", 1)) * int(parallel.get("nnodes", 1))
    if (layout := zero_layout(ckpt)) is not None:
        want, ranks = f"deepspeed_zero{layout[0]}", layout[1]
        if strategy != want or world != ranks:
            raise UserInputError(
                f"parallel.strategy: the checkpoint holds {want} optimizer partitions for {ranks} ranks; resume it "
                f"with --parallel.strategy {want} on {ranks} ranks, or start a new --out directory"
            )
    elif strategy in ZERO_STAGES and (sharded or ckpt.get(OPTIMIZER_STATES_KEY)):
        raise UserInputError(
            f"parallel.strategy: {strategy} resumes only checkpoints written by a DeepSpeed strategy; resume this "
            "one with the strategy that wrote it, or start a new --out directory"
        )


def check_resume_layout(checkpoint: Path, parallel: dict[str, Any]) -> None:
    """A single-file checkpoint (one process, DDP, DeepSpeed) holds the whole model as one state dict: a pipeline
    rank's module holds only its stages, so the load would fail on every rank ("Unexpected key(s)"). Refused with
    one line before any rank loads it. A sharded (DCP) checkpoint resumes under a pipeline whatever wrote it."""
    pp_size = int(parallel.get("pp_size", 1))
    directory = checkpoint_directory(checkpoint)
    manifest = read_manifest(directory)
    if pp_size <= 1 or manifest is None or manifest_layout(manifest) != "single-file":
        return
    strategy, world_size = manifest.get("strategy"), manifest.get("world_size")
    written_by = "one process" if strategy in (None, "single") else f"{strategy} on {world_size} ranks"
    raise ConfigError(
        "parallel.pp_size",
        f"the checkpoint {directory} is a single file (layout single-file, written by {written_by}), which the "
        f"{pp_size} pipeline stages cannot load; allowed: resume it with parallel.pp_size 1 (one process, DDP or "
        "FSDP), or start a new --out from its weights: gaudi3 ckpt export, then "
        "--model.init_from <the export>",
    )


def _newer_remote(
    cfg: RunConfig, manager: CheckpointManager, found: Path, warn: Callable[[str], None] | None
) -> Path:
    """Several nodes on their own disks: rank 0's node keeps the newest checkpoint and uploads it, the others hold
    what they fetched before, so a remote one newer than `found` is fetched and taken (every node must resume from
    the same: `train.nodes`). A store that cannot be read now leaves `found`, said via `warn`."""
    from gaudi3_scale.checkpoint.remote import fetch_latest

    assert cfg.checkpoint.remote_url is not None
    step = next(number for number, path in manager.steps() if path == found)
    try:
        newer = fetch_latest(cfg.checkpoint.remote_url, manager.directory, warn=warn, newer_than=step)
    except UserInputError as exc:
        if warn is not None:
            warn(f"resuming from the local {found.name}: {exc}")
        return found
    if newer is None:
        return found
    manager.mark_latest(newer)
    return newer


def resume_checkpoint(cfg: RunConfig, warn: Callable[[str], None] | None = None) -> Path | None:
    """The verified checkpoint state a run resumes from (train.resume: auto, never, a checkpoint or a run
    directory), or None.

    `auto` takes the newest checkpoint that verifies; a damaged or uncommitted one is skipped and named via `warn`.
    Light checkpoints (`<out>/light_checkpoints/`) are never taken: `auto` does not look there, a path is refused.
    With `checkpoint.remote_url` and no usable local checkpoint, the newest verified remote one is downloaded
    first (a fresh machine resumes from the remote copy alone). The download happens in the process that launches
    the ranks (or the only process), never in launched workers.
    """
    resume = cfg.train.resume
    manager = CheckpointManager(cfg.output_dir / "checkpoints")
    if resume == "auto":
        skipped: list[str] = []  # each damaged checkpoint passed over: named, and kept for the refusal below
        found = manager.latest_valid(warn=skipped.append)
        for message in skipped:
            if warn is not None:
                warn(message)
            else:
                warnings.warn(message, stacklevel=2)
        if found is None and cfg.checkpoint.remote_url and not inside_launched_worker():
            from gaudi3_scale.checkpoint.remote import fetch_latest

            found = fetch_latest(cfg.checkpoint.remote_url, manager.directory, warn=warn)
            if found is not None:
                manager.mark_latest(found)
        elif (
            found is not None
            and cfg.checkpoint.remote_url
            and cfg.parallel.nnodes > 1
            and not inside_launched_worker()
        ):
            found = _newer_remote(cfg, manager, found, warn)
        if found is None and any(has_manifest(path) for _, path in manager.steps()):
            # committed checkpoints, none intact: starting over would silently drop the training they hold
            raise UserInputError(
                f"train.resume: no checkpoint in {manager.directory} verifies ({skipped[0]}); restore one, move "
                "them aside to start over, or use a new --out directory"
            )
        return state_path(found) if found is not None else None
    if resume == "never":
        if manager.steps():
            raise UserInputError(
                f"{manager.directory} already holds checkpoints and train.resume is 'never'; use --train.resume "
                "auto to continue, or a new --out directory"
            )
        if cfg.checkpoint.remote_url and not inside_launched_worker():
            from gaudi3_scale.checkpoint.storage import remote_manifest

            if (
                remote_manifest(cfg.checkpoint.remote_url) is not None
            ):  # another run's: its uploads would be replaced
                raise UserInputError(
                    f"checkpoint.remote_url {cfg.checkpoint.remote_url} already holds checkpoints and train.resume is "
                    "'never'; use --train.resume auto to continue from them, or another remote_url"
                )
        return None
    if not Path(resume).exists():
        raise ConfigError(
            "train.resume", f"checkpoint {resume!r} does not exist; allowed: auto, never, or a path"
        )
    try:  # a run directory: its newest checkpoint that verifies
        directory = resolve_checkpoint(resume, warn=warn)
    except UserInputError as exc:
        raise ConfigError("train.resume", str(exc)) from None
    problems = verify_checkpoint(directory)
    if problems:
        raise ConfigError("train.resume", f"checkpoint {resume!r} is not usable: {problems[0]}")
    if is_light(read_manifest(directory)):
        raise ConfigError(
            "train.resume",
            f"{directory} is a light checkpoint (weights only: no optimizer, RNG or sampler state) and cannot be "
            "resumed; name a full one (the run's checkpoints/), or export this one with gaudi3 ckpt export",
        )
    return state_path(directory)
