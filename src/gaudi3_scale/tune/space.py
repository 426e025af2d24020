"""What the tuner may change: one `Candidate` per point of the search space, and how a space is built.

The global batch stays what the user asked for (or one of a user range): a candidate picks a micro-batch that
divides the per-rank batch, and gradient accumulation makes up the rest, so every candidate trains on the same
tokens per optimizer step.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.config.numbers import INT32_MAX, MAX_GLOBAL_BATCH_SIZE
from gaudi3_scale.device.float8 import float8_unsupported_reason
from gaudi3_scale.device.select import cpu_threads_per_rank, resolve_device
from gaudi3_scale.distributed.config import MESH_STRATEGIES, OFFLOAD_STRATEGIES
from gaudi3_scale.distributed.plan import BatchPlan, data_parallel_size
from gaudi3_scale.distributed.strategies import supported_strategies
from gaudi3_scale.train.config import RunConfig
from gaudi3_scale.train.train_config import fp8_option_defaults
from gaudi3_scale.tune.layouts import Layout, mesh_candidates

__all__ = [
    "Candidate",
    "SearchSpace",
    "available_strategies",
    "build_space",
    "device_kind",
    "divisors",
    "offload_options",
    "supported_precisions",
]

# Strategies the tuner compares at several ranks, in the order it tries them (cheapest communication first).
MULTI_RANK_STRATEGIES = ("ddp", "fsdp_grad_op", "fsdp", "deepspeed_zero2", "deepspeed_zero3")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    strategy: str
    precision: str
    global_batch_size: int
    micro_batch_size: int
    activation_checkpointing: bool
    compile: bool
    threads: int | None  # intra-op threads per rank (CPU); None = the run's default
    compile_mode: str = "default"  # reduce-overhead: CUDA graphs too (tried on CUDA once compile wins)
    tp_size: int = 1  # tensor-parallel ranks (fsdp, fsdp_grad_op on a Llama)
    dp_replicate: int = 1  # HSDP replicas
    offload: str = "none"  # tried only where the configuration does not fit without it
    pp_size: int = 1  # pipeline ranks (fsdp, fsdp_grad_op on a dense untied decoder), schedule `PP_SCHEDULE`
    pp_split: tuple[int, ...] = ()  # where stages 1, 2, … start (`balanced_split`); () = even

    def __post_init__(self) -> None:
        # a trial cache's JSON gives lists back; a tuple keeps the candidate hashable and its key the same
        object.__setattr__(self, "pp_split", tuple(self.pp_split))

    def batch_plan(self, world_size: int, context_length: int = 0) -> BatchPlan:
        """This candidate's batch on `world_size` ranks (tensor-parallel groups of `tp_size` × a pipeline of
        `pp_size` read one batch; the pipeline's micro-batches are the accumulation)."""
        return BatchPlan.build(
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            data_parallel_size=data_parallel_size(world_size, self.tp_size, self.pp_size),
            context_length=context_length,
        )

    def accumulation(self, world_size: int) -> int:
        return self.batch_plan(world_size).accumulation

    @property
    def key(self) -> str:
        """Stable identity of this point (the trial cache's key, with the run config's hash). Layout fields at
        their defaults are left out, so trials cached before they existed keep their keys."""
        fields = {
            k: v for k, v in asdict(self).items() if k not in _LAYOUT_DEFAULTS or v != _LAYOUT_DEFAULTS[k]
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def layout(self) -> Layout:
        """Its parallel layout, as the layout table names one."""
        return Layout(strategy=self.strategy, tp_size=self.tp_size, dp_replicate=self.dp_replicate,
                      activation_checkpointing=self.activation_checkpointing, offload=self.offload,
                      pp_size=self.pp_size, pp_split=self.pp_split)  # fmt: skip

    def overrides(self) -> list[str]:
        """The `gaudi3 train` config overrides that make a run this candidate (its layout's: every layout field,
        so a base config's own tensor or pipeline parallel never leaks into a candidate without it). The batch is
        its size in sequences: a config's train.global_batch_tokens (its own batch) is cleared, or every other
        global batch would be refused."""
        out = [
            *self.layout().overrides(),
            f"--train.precision={self.precision}",
            f"--train.global_batch_size={self.global_batch_size}",
            "--train.global_batch_tokens=null",
            f"--train.micro_batch_size={self.micro_batch_size}",
            f"--train.compile={str(self.compile).lower()}",
        ]
        if self.threads is not None:
            out.append(f"--train.threads={self.threads}")
        if self.compile_mode != "default" or not self.compile:
            # without compile, a config's own mode (max-autotune, …) would be refused; with it and mode "default",
            # the config's mode is the one measured (and written: tuner.winner_config)
            out.append(f"--train.compile_mode={self.compile_mode}")
        if self.precision != "fp8":
            # The config's train.fp8_* act in its fp8 candidates (the tuner does not search them); any other
            # precision holds them at their defaults, or the run would be refused.
            out += [
                f"--train.{k}={str(v).lower() if isinstance(v, bool) else v}"
                for k, v in fp8_option_defaults().items()
            ]
        return out

    def layout_name(self) -> str:
        """The strategy and the layout fields away from their defaults, e.g. "fsdp pp 2 tp 2"."""
        return " ".join([
            self.strategy,
            *([f"pp {self.pp_size}"] if self.pp_size > 1 else []),
            *([f"tp {self.tp_size}"] if self.tp_size > 1 else []),
            *([f"hsdp {self.dp_replicate}"] if self.dp_replicate > 1 else []),
            *([f"offload {self.offload}"] if self.offload != "none" else []),
        ])  # fmt: skip

    def label(self, world_size: int) -> str:
        parts = [
            self.layout_name(),
            self.precision,
            f"gb {self.global_batch_size}",
            f"mb {self.micro_batch_size}×{self.accumulation(world_size)}",
        ]
        if self.activation_checkpointing:
            parts.append("ckpt")
        if self.compile:
            parts.append("compile" if self.compile_mode == "default" else f"compile {self.compile_mode}")
        if self.threads is not None:
            parts.append(f"{self.threads} thr")
        return " ".join(parts)


_LAYOUT_DEFAULTS: dict[str, object] = {"tp_size": 1, "dp_replicate": 1, "offload": "none", "pp_size": 1,
                                       "pp_split": ()}  # fmt: skip


@dataclass(frozen=True)
class SearchSpace:
    world_size: int
    device: str
    strategies: tuple[str, ...]
    precisions: tuple[str, ...]
    global_batches: tuple[int, ...]
    activation_checkpointing: tuple[bool, ...]
    compile: tuple[bool, ...]
    threads: tuple[int | None, ...]
    # After compile wins on CUDA, the refinement tries CUDA graphs (train.compile_mode reduce-overhead) too.
    cuda_graphs: bool = False
    # (tp_size, pp_size, pp_split) for the mesh strategies (fsdp, fsdp_grad_op), `tune.layouts.mesh_candidates`:
    # tensor parallel over divisors of the node's ranks that divide the model's heads, kv heads and MLP width, ×
    # the pipelines (1F1B) its layers allow on the rest. HSDP replicates across nodes (one replica per node); the
    # tuner's trials run on one node, so its replicate is 1.
    meshes: tuple[tuple[int, int, tuple[int, ...]], ...] = ((1, 1, ()),)
    pipeline: tuple[bool, ...] = (
        False,
        True,
    )  # layouts without a pipeline, with one (`--pipeline off|on|both`)
    notes: tuple[str, ...] = ()  # what the space leaves out and why (printed with `describe`)

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({tp for tp, _, _ in self.meshes}))

    @property
    def pp_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({pp for _, pp, _ in self.meshes}))

    def micro_batches(self, global_batch: int, tp_size: int = 1, pp_size: int = 1) -> list[int]:
        """The micro-batches that divide a rank's share of `global_batch` on this space's ranks in tensor-parallel
        groups of `tp_size` × pipelines of `pp_size` (the whole share: `BatchPlan` without a micro-batch), and
        under a pipeline leave at least `pp_size` micro-batches a step (1F1B's minimum, `check_micro_batches`); a
        global batch that does not split over the data-parallel ranks is the plan's `ConfigError`."""
        dp = data_parallel_size(self.world_size, tp_size, pp_size)
        whole = BatchPlan.build(global_batch_size=global_batch, micro_batch_size=None, data_parallel_size=dp)
        share = whole.per_rank_batch_size
        return [mb for mb in divisors(share) if pp_size == 1 or share // mb >= pp_size]

    def meshes_for(self, strategy: str) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        """(tp_size, pp_size, pp_split) of `strategy`'s groups: for a mesh strategy the space's meshes, less the
        pipelines that no global batch of the space gives their pp_size micro-batches; else no mesh (none at all when
        the space searches pipelines only)."""
        if strategy not in MESH_STRATEGIES:
            return ((1, 1, ()),) if False in self.pipeline else ()
        return tuple(
            m
            for m in self.meshes
            if (m[1] > 1) in self.pipeline
            and any(self.micro_batches(gb, m[0], m[1]) for gb in self.global_batches)
        )

    def candidates(self) -> list[Candidate]:
        """Every point of the space (the exhaustive grid), in a fixed order."""
        out = []
        for strategy, (tp, pp, split) in ((s, m) for s in self.strategies for m in self.meshes_for(s)):
            for precision in self.precisions:
                for gb in self.global_batches:
                    for mb in self.micro_batches(gb, tp, pp):
                        for ckpt in self.activation_checkpointing:
                            for comp in self.compile:
                                if comp and strategy == "deepspeed_zero3":
                                    continue  # refused by the run config: dynamo cannot trace ZeRO-3's hooks
                                for threads in self.threads:
                                    out.append(
                                        Candidate(
                                            strategy=strategy,
                                            precision=precision,
                                            global_batch_size=gb,
                                            micro_batch_size=mb,
                                            activation_checkpointing=ckpt,
                                            compile=comp,
                                            threads=threads,
                                            tp_size=tp,
                                            pp_size=pp,
                                            pp_split=split,
                                        )
                                    )
        return out

    def describe(self) -> str:
        meshes = {m for s in self.strategies for m in self.meshes_for(s)}
        mbs = sorted(
            {
                mb
                for gb in self.global_batches
                for tp, pp, _ in meshes
                for mb in self.micro_batches(gb, tp, pp)
            }
        )
        tps, pps = sorted({tp for tp, _, _ in meshes}), sorted({pp for _, pp, _ in meshes})
        return (
            f"{len(self.candidates())} configurations: strategy {'/'.join(self.strategies)} × precision "
            f"{'/'.join(self.precisions)} × global batch {'/'.join(map(str, self.global_batches))} × micro-batch "
            f"{'/'.join(map(str, mbs))} × activation checkpointing {_onoff(self.activation_checkpointing)} × "
            f"compile {_onoff(self.compile)}"
            + (f" × tensor parallel {'/'.join(map(str, tps))}" if tps != [1] else "")
            + (f" × pipeline (1F1B) {'/'.join(map(str, pps))}" if pps != [1] else "")
            + (f" × threads {'/'.join(str(t) for t in self.threads)}" if self.threads != (None,) else "")
            + f", {self.world_size} rank(s) on {self.device}"
            + "".join(f"; {note}" for note in self.notes)
        )


def _onoff(values: tuple[bool, ...]) -> str:
    return "/".join("on" if v else "off" for v in values)


def offload_options(strategy: str) -> tuple[str, ...]:
    """The offloads `strategy` can run, lighter host traffic first (optimizer before all)."""
    return tuple(o for o in ("optimizer", "all") if strategy in OFFLOAD_STRATEGIES[o])


def divisors(n: int) -> list[int]:
    """The divisors of `n` >= 1, ascending: each d <= √n pairs with n // d, so √n steps, not n."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def device_kind(config: RunConfig) -> str:
    """`train.device` as the trials resolve it (`device.select.resolve_device`: auto is hpu on a Gaudi node)."""
    return resolve_device(config.train.device)


def _cpu_has_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX-512 BF16 or AMX); otherwise bf16 on CPU is emulated and never faster."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def supported_precisions(device: str) -> tuple[str, ...]:
    if device == "cuda":
        if not torch.cuda.is_bf16_supported():
            return ("16-mixed", "32-true")
        # fp8 only where it would run: compute capability >= 8.9 and torchao installed (device/float8.py).
        return ("bf16-mixed", "fp8") if float8_unsupported_reason("cuda") is None else ("bf16-mixed",)
    if device == "hpu":
        return ("bf16-mixed",)  # not yet validated on Gaudi hardware
    return ("32-true", "bf16-mixed") if _cpu_has_bf16() else ("32-true",)


def available_strategies(world_size: int, device: str = "cpu") -> tuple[str, ...]:
    """What the tuner compares: strategies the trainer builds on `device` (no DeepSpeed on Gaudi) whose library
    is installed."""
    if world_size == 1:
        return ("auto",)  # one device: nothing to shard; every strategy is plain training
    have_deepspeed = importlib.util.find_spec("deepspeed") is not None
    built = supported_strategies(device)
    return tuple(
        s for s in MULTI_RANK_STRATEGIES if s in built and (have_deepspeed or not s.startswith("deepspeed"))
    )


def _cpu_threads(world_size: int) -> tuple[int | None, ...]:
    """The run's default (usable cores ÷ ranks) and half of it: fewer threads per rank can win on busy hosts."""
    per_rank = cpu_threads_per_rank(world_size)
    return tuple(sorted({per_rank, max(1, per_rank // 2)}, reverse=True))


def _flag_grid(name: str, value: bool | tuple[bool, ...]) -> tuple[bool, ...]:
    """`True` → `(True,)`; a tuple or list of bools as a tuple, each value once; anything else one line naming
    the option."""
    grid = (value,) if isinstance(value, bool) else value
    if not isinstance(grid, tuple | list) or not grid or not all(isinstance(v, bool) for v in grid):
        raise UserInputError(
            f"{name}: expected True, False or a tuple of them such as (False, True), got {brief(value)}"
        )
    return tuple(dict.fromkeys(grid))


def _threads_grid(value: int | tuple[int | None, ...] | None) -> tuple[int | None, ...] | None:
    """`4` → `(4,)`; None stays None (the default); each count an integer from 1 to 2**31 - 1, or None. A count
    given twice (`--threads 1,1`) is one point of the grid, not two, so the space is not counted double."""
    if value is None:
        return None
    grid = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(grid, tuple | list) or not grid or not all(_is_thread_count(v) for v in grid):
        raise UserInputError(
            f"threads: expected a thread count, None or a tuple of them such as (8, 4), got {brief(value)}"
        )
    return tuple(dict.fromkeys(grid))


def _choices(value: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    """One name is a choice of one, not its letters ("ddp" → ("ddp",), as "d", "d", "p" it was refused); a name
    given twice (`--precisions 32-true,32-true`) is one choice, in the order first given."""
    if value is None:
        return None
    return tuple(dict.fromkeys((value,) if isinstance(value, str) else value))


def _is_thread_count(value: object) -> bool:
    if value is None:
        return True
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= INT32_MAX


def _refuse_empty(flag: str, allowed: str) -> None:
    raise UserInputError(f"{flag}: empty; allowed: {allowed}")


def build_space(
    config: RunConfig,
    *,
    world_size: int,
    global_batches: tuple[int, ...] | None = None,
    strategies: str | tuple[str, ...] | None = None,
    precisions: str | tuple[str, ...] | None = None,
    activation_checkpointing: bool | tuple[bool, ...] = (False, True),
    compile: bool | tuple[bool, ...] = (False, True),
    threads: int | tuple[int | None, ...] | None = None,
    pipeline: bool | tuple[bool, ...] = (False, True),
) -> SearchSpace:
    """The space for `config` on `world_size` ranks; bad choices get one line naming the flag. A grid option
    (`activation_checkpointing`, `compile`, `pipeline`, `threads`) given as one value is a grid of that value. A
    choice given but empty (`--precisions ,`) is refused: as "all" it would start the whole search by mistake."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UserInputError(f"--world-size must be an integer >= 1, got {brief(world_size)}")
    if threads is not None and not isinstance(threads, int) and len(threads) == 0:
        _refuse_empty("--threads", "CPU threads per rank from 1 to 2**31 - 1, comma-separated")
    activation_checkpointing = _flag_grid("activation_checkpointing", activation_checkpointing)
    compile = _flag_grid("compile", compile)
    if config.train.hpu_graphs and True in compile:
        # refused by the run config: torch.compile runs in eager mode on Gaudi, HPU graphs in lazy mode
        if compile == (True,):
            raise UserInputError(
                "--compile: on cannot run with train.hpu_graphs (torch.compile runs in eager mode on Gaudi, HPU "
                "graphs in lazy mode); allowed: --compile off, or train.hpu_graphs false"
            )
        compile = (False,)
    pipeline = _flag_grid("pipeline", pipeline)
    threads = _threads_grid(threads)
    strategies = _choices(strategies)
    precisions = _choices(precisions)
    device = device_kind(config)
    if global_batches is not None and len(global_batches) == 0:
        _refuse_empty(
            "--global-batch", f"multiples of the world size ({world_size}) up to {MAX_GLOBAL_BATCH_SIZE:,}"
        )
    batches = global_batches or (config.train.global_batch_size,)
    for gb in batches:
        if gb > MAX_GLOBAL_BATCH_SIZE:
            where = "--global-batch" if global_batches else "train.global_batch_size"
            raise UserInputError(
                f"{where}: the tuner searches global batches of 1 to {MAX_GLOBAL_BATCH_SIZE:,} sequences, got {gb:,}"
            )
        if gb < world_size or gb % world_size:
            raise UserInputError(
                f"global batch {gb} sequences cannot be split over {world_size} ranks: it must be a multiple of "
                f"the world size (e.g. {max(world_size, gb // world_size * world_size)} or "
                f"{(gb // world_size + 1) * world_size})"
            )
    allowed = available_strategies(world_size, device)
    if strategies is not None and len(strategies) == 0:
        _refuse_empty("--strategies", ", ".join(allowed))
    if strategies:
        unknown = [s for s in strategies if s not in allowed]
        if unknown:
            raise UserInputError(
                f"--strategies: {', '.join(unknown)} not available with {world_size} rank(s); "
                f"allowed: {', '.join(allowed)}"
            )
    supported = supported_precisions(device)
    if precisions is not None and len(precisions) == 0:
        _refuse_empty("--precisions", ", ".join(supported))
    notes: tuple[str, ...] = ()
    if precisions:
        unknown = [p for p in precisions if p not in supported]
        if unknown:
            raise UserInputError(
                f"--precisions: {', '.join(unknown)} not supported on {device} here; allowed: {', '.join(supported)}"
            )
    else:
        supported, notes = fp8_if_it_pays(config, supported)
    if threads is None:
        threads = _cpu_threads(world_size) if device == "cpu" else (None,)
    meshes = mesh_candidates(config.model, "fsdp", world_size=world_size, per_node=world_size)
    space = SearchSpace(
        world_size=world_size,
        device=device,
        strategies=tuple(strategies or allowed),
        precisions=tuple(precisions or supported),
        global_batches=tuple(sorted(set(batches))),
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        threads=threads,
        cuda_graphs=device == "cuda" and True in compile,
        meshes=tuple(meshes),
        pipeline=pipeline,
        notes=notes,
    )
    if not space.candidates() and pipeline == (True,):
        raise UserInputError(
            "--pipeline on: no pipeline layout in this search; one needs fsdp or fsdp_grad_op among the strategies, "
            "a dense decoder without tied embeddings (not an encoder or a mixture of experts), layers that split "
            "into 2, 4, 8 or 16 stages over the ranks, and a global batch of at least pp_size sequences per "
            "pipeline; allowed here: --pipeline off or both"
        )
    return space


def fp8_if_it_pays(config: RunConfig, precisions: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`precisions` without fp8 where its modelled gain for the config's model, context and `train.fp8_*` is below
    `MIN_FP8_GAIN` (`tune.fp8_gain`), and the note saying so; `--precisions fp8` asks for it anyway."""
    if "fp8" not in precisions:
        return precisions, ()
    from gaudi3_scale.tune.estimate_table import resolved_model
    from gaudi3_scale.tune.fp8_gain import MIN_FP8_GAIN, fp8_gain

    plan = config.float8_plan()
    gain = fp8_gain(resolved_model(config.model, config.data).resolve_padding("cuda"), plan)
    if gain.pays:
        return precisions, (f"fp8 ({plan.recipe}) modelled at ×{gain.gain:.2f} bf16 (tune.fp8_gain)",)
    note = (
        f"fp8 left out: {plan.recipe} is modelled at ×{gain.gain:.2f} bf16 tokens/s for this model, below "
        f"×{MIN_FP8_GAIN} ({gain.share:.0%} of its FLOPs in linears fp8 speeds up; tune.fp8_gain); "
        "--precisions fp8 tries it anyway"
    )
    return tuple(p for p in precisions if p != "fp8"), (note,)
