"""Which parallel layouts a model could train with on N accelerators, whether each fits, and why not.

A layout is a strategy the trainer builds on that device (`distributed.strategies.STRATEGIES_BY_DEVICE`: no
DeepSpeed on Gaudi) × tensor parallel × HSDP replication × pipeline parallel (FSDP strategies: 1F1B over pp 2, 4, 8
or 16 stages where the ranks and the layers allow, `distributed.schedule_math.balanced_split`) × activation
checkpointing, and CPU offload only where the same layout does not fit without it. A pipeline layout is estimated
with pp_size micro-batches per step, the fewest 1F1B runs: its first stage then holds pp_size micro-batches, as
many as with any larger count (`distributed.schedule_math.in_flight_micro_batches`). Each is checked with `tune.memory` against the accelerator's memory
(`device/accelerators.yaml`); what offload moves to the host is summed per node.

Ranking (fastest first) — every layout of one model on the same N devices does the same useful FLOPs, so what
separates them is what each choice adds to a step. The model, ordinal and stated rather than timed:
1. offload: none < optimizer < all. ZeRO-Offload moves gradients to and parameters from the host once per step
   and runs AdamW on the CPU (Ren et al. 2021, arXiv:2101.06840); "all" also copies every block's parameters to
   the device in forward and backward — host-link traffic of the model's size per pass.
2. activation checkpointing: off < on. Recomputing each block's forward is +1/3 of the 6·N FLOPs per token
   (8·N, Korthikanti et al. 2022, §5).
3. pipeline parallel: none < smaller pp. A pipeline idles (p − 1)/(m + p − 1) of a step (1F1B; a few % with many
   micro-batches, less than checkpointing's third) and sends b·s·h activations between stages; with the ranks of a
   node used for tensor parallel first (Narayanan et al. 2021, arXiv:2104.04473 §3.3, takeaway #1: tensor parallel
   up to the node's size, pipeline parallel across nodes), so a smaller pp comes before a smaller tp.
4. tensor parallel: smaller tp first. Megatron TP with sequence parallel all-gathers and reduce-scatters the
   s·b·h activations twice per block in forward and twice in backward (`TP_BYTES_PER_TOKEN`), on the critical
   path (FSDP's collectives overlap compute; these do not).
5. strategy: the tuner's order, cheapest communication first (ddp, fsdp_grad_op, fsdp, deepspeed_zero2, zero3).
6. HSDP before FSDP over every rank: parameters are gathered within a node instead of across nodes.
7. a larger micro-batch that fits (higher arithmetic intensity per kernel).
Measured throughput (`gaudi3 tune` trials) decides between layouts this model cannot separate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gaudi3_scale.device.float8 import Float8Plan
from gaudi3_scale.distributed.config import MESH_STRATEGIES, OFFLOAD_STRATEGIES
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.distributed.schedule_math import balanced_split
from gaudi3_scale.distributed.strategies import supported_strategies
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.tune.memory import (
    MemoryEstimate,
    estimate_memory,
    max_micro_batch_that_fits,
    process_peak_bytes,
)

__all__ = [
    "Layout",
    "LayoutCheck",
    "check_layouts",
    "mesh_candidates",
    "tensor_parallel_sizes",
    "tp_bytes_per_token",
]

# The tuner's order (cheapest communication first); auto is plain training on one device.
STRATEGY_ORDER = ("auto", "ddp", "fsdp_grad_op", "fsdp", "deepspeed_zero2", "deepspeed_zero3")
OFFLOAD_ORDER = ("none", "optimizer", "all")
PP_SIZES = (2, 4, 8, 16)  # pipeline candidates (Llama 3 405B trained with PP 16, Dubey et al. 2024 §3.3.2)
PP_SCHEDULE = (
    "1f1b"  # the candidates' schedule: torchtitan's default, 1F1B's memory, no second stage per rank
)
_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Layout:
    strategy: str
    tp_size: int = 1
    dp_replicate: int = 1
    activation_checkpointing: bool = False
    offload: str = "none"
    pp_size: int = 1  # pipeline stages (1F1B, `PP_SCHEDULE`)
    pp_split: tuple[int, ...] = ()  # where stages 1, 2, … start; () = even

    def label(self, world_size: int) -> str:
        shard = world_size // (self.tp_size * self.dp_replicate * self.pp_size)
        if world_size == 1:
            mesh = "on one device"
        elif self.strategy in MESH_STRATEGIES:
            pipeline = f"pp {self.pp_size} ({PP_SCHEDULE}) × " if self.pp_size > 1 else ""
            mesh = f"{pipeline}tp {self.tp_size} × replicate {self.dp_replicate} × shard {shard}"
        else:
            mesh = f"over {world_size} rank(s)" + (" (replicated)" if self.strategy == "ddp" else "")
        return (
            f"{self.strategy} {mesh}, act.ckpt {'on' if self.activation_checkpointing else 'off'}, "
            f"offload {self.offload}"
        )

    def parallel_fields(self) -> dict[str, Any]:
        """This layout as `parallel.*` run-config fields: every one it sets, at its defaults too, so a base config's
        own mesh never leaks into a layout without one."""
        return {
            "strategy": self.strategy,
            "tp_size": self.tp_size,
            "dp_replicate": self.dp_replicate,
            "activation_checkpointing": self.activation_checkpointing,
            "offload": self.offload,
            "pp_size": self.pp_size,
            "pp_split": list(self.pp_split),
            **({"pp_schedule": PP_SCHEDULE} if self.pp_size > 1 else {}),
        }

    def overrides(self) -> list[str]:
        """The `gaudi3 train` overrides for this layout (`parallel_fields`)."""
        return [
            f"--parallel.{name}={_override_value(value)}" for name, value in self.parallel_fields().items()
        ]


def _override_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return f"[{','.join(map(str, value))}]"
    return str(value)


@dataclass(frozen=True, kw_only=True)
class LayoutCheck:
    layout: Layout
    estimate: MemoryEstimate
    device_bytes: int  # the accelerator's memory
    host_bytes_per_node: int  # what offload keeps on the host, for every rank of a node
    host_limit_bytes: int | None  # the node's host RAM, None = unknown (not checked)
    max_micro_batch: int  # the largest micro-batch that fits (0 = none)

    @property
    def fits(self) -> bool:
        host_ok = self.host_limit_bytes is None or self.host_bytes_per_node <= self.host_limit_bytes
        return self.need_bytes <= self.device_bytes and host_ok

    @property
    def need_bytes(self) -> int:
        """What the layout takes per device: on a CPU with what glibc keeps (`tune.memory.process_peak_bytes`)."""
        return process_peak_bytes(self.estimate)

    def reason(self, device_name: str) -> str:
        need = self.need_bytes
        if need > self.device_bytes:
            return f"needs {need / _GIB:.1f} GiB per device, the {device_name} has {self.device_bytes / _GIB:.1f} GiB"
        if self.host_limit_bytes is not None and self.host_bytes_per_node > self.host_limit_bytes:
            return (
                f"offload needs {self.host_bytes_per_node / _GIB:.1f} GiB of host memory per node, a node has "
                f"{self.host_limit_bytes / _GIB:.1f} GiB"
            )
        return ""

    def rank_key(self) -> tuple[int, int, bool, int, int, int, bool, int]:
        """Smaller is faster under the module docstring's model; layouts that do not fit last."""
        lay = self.layout
        return (
            not self.fits,
            OFFLOAD_ORDER.index(lay.offload),
            lay.activation_checkpointing,
            lay.pp_size,
            lay.tp_size,
            STRATEGY_ORDER.index(lay.strategy),
            lay.dp_replicate == 1,
            -self.max_micro_batch,
        )


def tensor_parallel_sizes(model: ModelConfig, per_node: int) -> list[int]:
    """tp sizes the trainer accepts (the run config's own check): divisors of the node's accelerators that divide
    the query heads, key/value heads, MLP width and context; dense Llama only."""
    from gaudi3_scale.config.errors import ConfigError
    from gaudi3_scale.train.config import check_tensor_parallel

    def accepted(tp: int) -> bool:
        try:
            check_tensor_parallel(model, tp)
        except ConfigError:
            return False
        return True

    return [t for t in range(1, per_node + 1) if per_node % t == 0 and accepted(t)]


def tp_bytes_per_token(model: ModelConfig, tp_size: int, *, element_bytes: int = 2) -> float:
    """Bytes one rank sends per token in tensor-parallel collectives (sequence parallel): per block, 2 all-gathers
    and 2 reduce-scatters of h activations in forward and as many in backward, each moving (tp-1)/tp of them."""
    return 8 * model.num_layers * model.dim * element_bytes * (tp_size - 1) / tp_size


def candidate_layouts(
    model: ModelConfig, *, device_kind: str, world_size: int, per_node: int
) -> list[Layout]:
    """Every layout without offload the trainer would build on `world_size` ranks of `per_node` per node."""
    nnodes = max(1, world_size // per_node)
    if world_size == 1:  # nothing to shard or replicate: plain training (ddp over HCCL on Gaudi)
        return [Layout(strategy="auto", activation_checkpointing=ckpt) for ckpt in (False, True)]
    strategies = [s for s in STRATEGY_ORDER[1:] if s in supported_strategies(device_kind)]
    out = []
    for strategy in strategies:
        mesh = strategy in MESH_STRATEGIES
        tps = tensor_parallel_sizes(model, min(per_node, world_size)) if mesh else [1]
        for tp in tps:
            # HSDP: one replica per node, FSDP inside it (the natural split: all-gathers stay on the node).
            replicas = (
                sorted({1, nnodes}) if mesh and nnodes > 1 and (world_size // tp) % nnodes == 0 else [1]
            )
            for replicate in replicas:
                for pp, split in _pipelines(model, world_size // (tp * replicate)) if mesh else [(1, ())]:
                    for ckpt in (False, True):
                        out.append(
                            Layout(
                                strategy=strategy,
                                tp_size=tp,
                                dp_replicate=replicate,
                                activation_checkpointing=ckpt,
                                pp_size=pp,
                                pp_split=split,
                            )
                        )
    return out


def mesh_candidates(
    model: ModelConfig, strategy: str, *, world_size: int, per_node: int
) -> list[tuple[int, int, tuple[int, ...]]]:
    """(tp_size, pp_size, pp_split) of `strategy` on `world_size` ranks: no mesh, and for the FSDP strategies
    tensor parallel inside a node × the pipelines the layers allow (`cost compare` sizes its fewest devices with
    these)."""
    if strategy not in MESH_STRATEGIES or world_size == 1:
        return [(1, 1, ())]
    out = []
    for tp in tensor_parallel_sizes(model, min(per_node, world_size)):
        out += [(tp, pp, split) for pp, split in _pipelines(model, world_size // tp)]
    return out


def _pipelines(model: ModelConfig, ranks: int) -> list[tuple[int, tuple[int, ...]]]:
    """(pp_size, pp_split) for no pipeline and each `PP_SIZES` that divides the `ranks` of one tensor-parallel
    slice of a replica and whose stages the layers allow (a model the trainer pipelines: dense, untied decoder)."""
    out: list[tuple[int, tuple[int, ...]]] = [(1, ())]
    if model.arch == "bert" or model.num_experts or model.tie_embeddings:
        return out
    for pp in PP_SIZES:
        split = balanced_split(model.num_layers, pp)
        if ranks % pp == 0 and split is not None:
            out.append((pp, split))
    return out


@dataclass(frozen=True, kw_only=True)
class _Target:
    """What every layout is checked against: the ranks, the devices and the batch."""

    world_size: int
    per_node: int
    micro_batch_size: int
    precision: str
    device_kind: str
    device_bytes: int
    host_limit_bytes: int | None
    compiled: bool = False
    float8: Float8Plan | None = None


def _check(model: ModelConfig, layout: Layout, t: _Target) -> LayoutCheck:
    plan = ParallelPlan.build(
        strategy=layout.strategy,
        world_size=t.world_size,
        tp_size=layout.tp_size,
        dp_replicate=layout.dp_replicate,
        offload=layout.offload,
        activation_checkpointing=layout.activation_checkpointing,
        compile=t.compiled,
        float8=t.float8,
        pp_size=layout.pp_size,
        pp_schedule=PP_SCHEDULE,
        pp_split=layout.pp_split,
    )
    batch = BatchPlan.from_micro_batch(
        t.micro_batch_size, accumulation=layout.pp_size, data_parallel_size=plan.data_parallel_size
    )
    best = max_micro_batch_that_fits(
        model, plan, budget_bytes=t.device_bytes, limit=256, precision=t.precision, device_kind=t.device_kind
    )
    est = estimate_memory(model, plan, batch, precision=t.precision, device_kind=t.device_kind)
    return LayoutCheck(
        layout=layout,
        estimate=est,
        device_bytes=t.device_bytes,
        host_bytes_per_node=est.host_bytes * min(t.per_node, t.world_size),
        host_limit_bytes=t.host_limit_bytes,
        max_micro_batch=best,
    )


def check_layouts(
    model: ModelConfig,
    *,
    world_size: int,
    per_node: int,
    device_kind: str,
    device_bytes: int,
    micro_batch_size: int = 1,
    precision: str = "bf16-mixed",
    host_limit_bytes: int | None = None,
    compiled: bool = False,
    float8: Float8Plan | None = None,
) -> list[LayoutCheck]:
    """Every candidate layout checked, fastest first (module docstring); an offloaded variant is added only for a
    layout that does not fit on the device without it. `compiled`, `float8`: as `estimate_memory`."""
    target = _Target(
        world_size=world_size,
        per_node=per_node,
        micro_batch_size=micro_batch_size,
        precision=precision,
        device_kind=device_kind,
        device_bytes=device_bytes,
        host_limit_bytes=host_limit_bytes,
        compiled=compiled,
        float8=float8,
    )
    checks = []
    for layout in candidate_layouts(model, device_kind=device_kind, world_size=world_size, per_node=per_node):
        check = _check(model, layout, target)
        checks.append(check)
        if check.need_bytes <= device_bytes:
            continue
        for offload in OFFLOAD_ORDER[1:]:
            if layout.strategy in OFFLOAD_STRATEGIES[offload]:
                checks.append(_check(model, replace(layout, offload=offload), target))
    return sorted(checks, key=LayoutCheck.rank_key)
