"""Analytic peak memory per rank of one training step, from the model shape alone: nothing is built or run.

The tuner prunes with it before any trial, and `gaudi3 tune --estimate-only` prints it as a table (`tune.estimate_table`). Every
byte is one of: parameters, gradients, optimizer state, saved activations, workspace (short-lived buffers), runtime
(what the process holds before the model exists). What THIS codebase allocates is modelled, not a textbook run;
`benchmarks/bench_memory_estimate.py` compares the estimate with measured peaks (error table in its results).

Model states — ZeRO (Rajbhandari et al., SC'20, arXiv:1910.02054, §3.1 and Fig. 1): mixed-precision Adam holds
2Ψ (fp16 weights) + 2Ψ (fp16 gradients) + KΨ (K = 12: fp32 master weights, momentum, variance); stage 2 partitions
gradients and optimizer state over N_d ranks, 2Ψ + 14Ψ/N_d; stage 3 partitions all, 16Ψ/N_d. Here the bytes per
element follow the precision this code actually runs (see `element_bytes`): "32-true" keeps fp32 weights,
gradients and AdamW moments (16Ψ, no separate master); Lightning's "bf16-mixed" keeps fp32 weights and gradients
and autocasts, so each matmul weight also exists as a bf16 copy saved for backward (cache_enabled=False, one copy
per use); FSDP2 with bf16-mixed gathers bf16 parameters (MixedPrecisionPolicy) over fp32 shards; "bf16-true"
stores everything, AdamW moments included, in bf16 (8Ψ); DeepSpeed with bf16 holds bf16 module weights plus fp32
master partitions (K = 12, as in the paper).

Activations and the loss workspace: `tune.activations` (Korthikanti et al., arXiv:2205.05198, adapted tensor by
tensor to our blocks, with tensor and sequence parallel).

Phases. Not everything is alive at once: gradients are freed (set_to_none) after each optimizer step while
activations are freed during backward. The peak is the largest of these moments, each summed term by term: "init"
(DeepSpeed: the model built whole before it is partitioned; FSDP builds on meta and has none), "backward start" (all
activations, loss workspace; with gradient accumulation, also the gradients the earlier micro-batches of the step
left: `train/module.py` zeroes them only after the optimizer step), "backward end" (all gradients; a tied
embedding/head then has three V·h gradients alive: the head's, the embedding's and their sum), "optimizer step". The
breakdown reported is the one of the peak moment.
Per strategy:
* single (one process): with accumulation, every micro-batch after the first starts backward with the whole
  model's gradients alive;
* ddp: gradients live in all-reduce buckets for the whole run (`gradient_as_bucket_view=True`); with accumulation
  the micro-steps before the last run without sync (`distributed.grad_sync`, DDP's `no_sync`), so their gradients
  accumulate in `.grad` tensors of their own (DDP's reducer makes `.grad` a bucket view only when it syncs, and
  `zero_grad(set_to_none=True)` drops the view): a second full set of gradients beside the buckets;
* fsdp / fsdp_grad_op (FSDP2 `fully_shard` per block, then the root): shards of parameters, gradients and AdamW
  state over N, sized by the rank the trainer's shard plan gives the most (`distributed.shard_plan`: uneven
  dim-0 chunks, experts sharded on dim 1 when they do not divide over the ranks); gathered copies of two blocks in backward (current + prefetch) or, with reshard_after_forward=False,
  of every block from forward to backward; the root (embeddings, final norm, head) gathered, its gradients unsharded
  until the end of backward, then copied into a reduce-scatter input (N > 1; with N = 1 the shard is the gradient);
  FSDP2 reduce-scatters at every backward (`distributed.grad_sync`), so with accumulation the sharded gradients
  (not the unsharded ones) are kept across micro-steps;
* deepspeed_zero2: whole flat weights, master + moments (12Ψ/N) and the gradient partition, which, as ZeRO-2
  partitions gradients, is all a rank keeps across accumulation micro-steps (reduced into it at each backward); the
  step flattens a fp32 gradient partition; deepspeed_zero3: everything /N, plus the live gathered parameters the
  strategy allows (`distributed/deepspeed.py`: 24·h² elements, about two blocks, but at least the largest module:
  the V·h head).

Layouts (`tp_size`, `dp_replicate`, `offload`, as `parallel.*`):
* tensor parallel (Megatron, Shoeybi et al. 2019; the plan of `distributed/tensor_parallel.py`): every matrix, the
  embedding table and the head split over tp ranks, norm weights replicated; FSDP then shards what is left. With
  sequence parallel (Korthikanti §4.2.2) the norms, the residual stream and the attention/MLP tensors are split
  over tp, but DTensor saves the all-gathered inputs of the column-parallel linears whole (Megatron re-gathers
  them in backward instead); the loss runs on vocabulary-sharded logits (loss parallel), b·s·V/tp;
* HSDP: FSDP shards over dp_shard = world / (tp · dp_replicate) ranks, one replica; the replicas' all-reduce of
  the gradient shards needs no more memory;
* offload (not on a CPU run, where the host is the device): FSDP2's CPUOffloadPolicy keeps parameter shards,
  their gradients and AdamW state in host memory (the device holds what is gathered and the unsharded gradients
  before their reduce-scatter); DeepSpeed's offload_optimizer (ZeRO-Offload, Ren et al. 2021, arXiv:2101.06840)
  keeps master weights, moments and the fp32 gradient partition on the host (one h² reduce bucket of gradients on
  the device), offload_param (stage 3) the 16-bit partition too. `host_bytes` is the host's share per rank.

Empirical terms, labelled as such: the CPU runtime baseline (peak RSS of the Python/torch/Lightning process with a
negligible model) and DeepSpeed's import, measured by the benchmark; on CUDA `max_memory_allocated` excludes the
context, so the runtime term is 0; on HPU it is unknown and left out. Not modelled: allocator fragmentation, data-loader workers, token/target ids (16·b·s bytes). `compiled`
(`train.compile`) takes what torch.compile's partitioner saves instead of what eager autograd does
(`tune.activations`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.device.float8 import Float8Plan
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.counting import from_one_and_two_blocks
from gaudi3_scale.tune.activations import (
    ElementBytes,
    ModelShape,
    activation_bytes,
    element_bytes,
    loss_workspace_bytes,
    model_shape,
    tp_shape,
)
from gaudi3_scale.tune.pipeline_shape import RankStages, pipeline_activation_bytes, rank_stages

__all__ = [
    "CPU_DEEPSPEED_IMPORT_BYTES",
    "CPU_RUNTIME_BYTES",
    "GLIBC_RETAINED_MAX_BYTES",
    "GLIBC_RETAINED_SHARE",
    "MMAP_THRESHOLD_ENV",
    "MemoryEstimate",
    "allocator_retained_bytes",
    "estimate_activation_bytes",
    "estimate_memory",
    "max_micro_batch_that_fits",
    "process_peak_bytes",
]

DEVICE_KINDS = ("cpu", "cuda", "hpu")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "fp8")
OPTIMIZER_STATES = {"adamw": 2}  # tensors of optimizer state per parameter: AdamW's exp_avg and exp_avg_sq

# Empirical, calibrated by benchmarks/bench_memory_estimate.py (2026-11-23; torch 2.13 CPU, Lightning 2.6, Python
# 3.11, RSS with MALLOC_MMAP_THRESHOLD_=131072): peak RSS of a training process minus the estimate of its negligible
# model: the interpreter, torch, Lightning and our code, plus the library pages the kernels touch (~105 MiB of it
# file-backed). DeepSpeed's import (ops, accelerator registry) adds its own.
CPU_RUNTIME_BYTES = 390 * 2**20
CPU_DEEPSPEED_IMPORT_BYTES = 73 * 2**20

# The estimate above is calibrated with MALLOC_MMAP_THRESHOLD_=131072, where glibc hands freed tensors back at once.
# Setting it for a run costs speed (every large tensor becomes an mmap and its pages are zeroed again: the default
# run's step was several times slower with it), so runs keep glibc's default, which keeps part of what a step frees
# (still resident: the OS cannot give it to anyone else). Its excess over the estimate, on bench_foresight's 7 CPU
# cases (2026-11-29, 0.4–0.7 GB peaks): +6 … +28 % of the estimate. 16 % puts all 7 within ±10 % (−9.4 … +9.6 %);
# it is fitted on those cases, so they are not an independent check of it. It is not a share of larger runs: glibc
# serves allocations above its mmap threshold (dynamic, at most 32 MiB on 64-bit: mallopt(3), M_MMAP_THRESHOLD) by
# mmap and unmaps them when freed, so what it keeps is the churn of the smaller ones. On 2.0–3.8 GiB CPU runs
# (2026-11-30, tune's F9/F13 checks: a 2-layer Llama at 32-true and bf16-mixed on one process at accumulation 1, 2
# and 4, and on DDP over 2 ranks at 1 and 4; 9 measurements) the excess of peak RSS over the estimate was 28–174 MiB
# (+1 … +4 %), where 16 % would say +11 … +14 %. Capped at 148 MiB, all 9 are within −0.6 … +5.7 % and the 7 small
# cases are unchanged (16 % of them is below the cap).
GLIBC_RETAINED_SHARE = (0.16, "glibc's default allocator keeps part of what a step frees: +16 % of the estimate, "
                        "at most 148 MiB (fitted on bench_foresight's 7 CPU cases, 2026-11-29, and 9 larger "
                        "runs, 2026-11-30)")  # fmt: skip
GLIBC_RETAINED_MAX_BYTES = 148 * 2**20
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Peak bytes per rank, split into what is alive at the peak moment (`peak_phase`); `total_bytes` sums them."""

    strategy: str  # resolved: "single" is one process without DDP
    world_size: int  # all ranks: tp_size × dp_replicate × dp_shard
    micro_batch_size: int
    context_length: int
    precision: str  # resolved ("auto" → the device's default)
    activation_checkpointing: bool
    device_kind: str
    parameters: int  # elements in the whole model (tied weights once)
    peak_phase: str  # "init", "backward start", "backward end" or "optimizer step"
    params_bytes: int  # stored weights + gathered/cast copies alive at the peak
    grads_bytes: int
    optimizer_bytes: int  # AdamW moments (+ fp32 master weights where the strategy keeps them)
    activations_bytes: int  # saved for backward
    workspace_bytes: int  # loss/logits work, transient gradients, communication buffers
    runtime_bytes: int  # process baseline (empirical on CPU)
    tp_size: int = 1  # tensor-parallel ranks per replica
    dp_replicate: int = 1  # HSDP replicas; FSDP shards over world_size / (tp_size × dp_replicate) ranks
    offload: str = "none"  # none, optimizer or all (parallel.offload)
    host_bytes: int = 0  # what offload keeps in host memory for this rank (not in total_bytes); 0 on cpu
    compiled: bool = False  # train.compile: activations as torch.compile's partitioner saves them
    pp_size: int = 1  # pipeline ranks (parallel.pp_size)
    pp_schedule: str = ""  # parallel.pp_schedule when pp_size > 1
    pp_rank: int = 0  # the pipeline rank this estimate is of (by default the one with the largest peak)
    pp_stages: tuple[int, ...] = ()  # the stage indices that rank holds
    in_flight_micro_batches: int = (
        1  # micro-batches whose activations that rank holds at its peak (all its stages)
    )

    @property
    def total_bytes(self) -> int:
        """Device memory at the peak (host memory of an offloaded run is `host_bytes`)."""
        return sum(b for _, b in self.rows())

    @property
    def dp_shard(self) -> int:
        """Ranks each parameter is sharded over (FSDP within one HSDP replica; ZeRO over all ranks)."""
        return self.world_size // (self.tp_size * self.dp_replicate)

    def rows(self) -> list[tuple[str, int]]:
        """(component, bytes) in the table's order."""
        return [
            ("params", self.params_bytes),
            ("grads", self.grads_bytes),
            ("optimizer", self.optimizer_bytes),
            ("activations", self.activations_bytes),
            ("workspace", self.workspace_bytes),
            ("runtime", self.runtime_bytes),
        ]


@dataclass(frozen=True)
class _Phase:
    name: str
    params: float
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    workspace: float = 0.0
    host: float = 0.0  # offloaded to host memory (not in total)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.workspace


@dataclass(frozen=True)
class _Run:
    sh: ModelShape  # one tensor-parallel rank's parameters (the whole model without tensor parallel)
    whole: ModelShape
    e: ElementBytes
    n: int
    b: int
    s: int
    ckpt: bool
    device_kind: str
    states: int
    tp: int = 1
    offload: str = "none"
    compiled: bool = False  # train.compile: torch.compile's partitioner decides what is saved
    float8: Float8Plan | None = None  # train.precision fp8: how the linears are converted
    shard: float = 0.0  # FSDP: parameter elements on the rank holding the most (`distributed.shard_plan`)
    pipeline: RankStages | None = None  # pipeline parallel: this rank's stages; `sh` is then their parameters
    accumulation: int = 1  # micro-batches per optimizer step (BatchPlan.accumulation)

    @property
    def accumulates(self) -> bool:
        """Whether a backward can start with the gradients of the step's earlier micro-batches alive (a pipeline's
        schedule runs them itself: `_pipelined`)."""
        return self.accumulation > 1

    @property
    def fp8_inputs(self) -> bool:
        """Compiled fp8 keeps the converted linears' inputs in fp8; rowwise_with_gw_hp's weight gradient needs
        them in high precision (tune.activations)."""
        return self.compiled and self.float8 is not None and self.float8.recipe != "rowwise_with_gw_hp"

    @property
    def activations(self) -> float:
        if self.pipeline is not None:
            return pipeline_activation_bytes(
                self.pipeline, self.b, self.s, self.e, self.ckpt, self.device_kind, self.tp,
                compiled=self.compiled, fp8_inputs=self.fp8_inputs,
            )  # fmt: skip
        return activation_bytes(
            self.whole, self.b, self.s, self.e, self.ckpt, self.device_kind, self.tp,
            compiled=self.compiled, fp8_inputs=self.fp8_inputs,
        )  # fmt: skip

    def optimizer(self, shards: int) -> float:
        return (self.states * self.e.state + self.e.master) * self.sh.params / shards

    def shard_optimizer(self) -> float:
        """FSDP: AdamW state of the largest rank's shards."""
        return (self.states * self.e.state + self.e.master) * self.shard

    def loss(self, head_grad_bytes: int) -> float:
        return loss_workspace_bytes(
            replace(self.whole, last=self.sh.last),
            self.b,
            self.s,
            self.e,
            head_grad_bytes,
            self.tp,
            compiled=self.compiled,
        )

    def weight_casts(self) -> float:
        """bf16 copies autocast makes of the matmul weights and keeps for backward (norms/biases: < 0.2 %); fp8's
        converted linears (every block's; the head with `float8.head`) keep none (tune.activations)."""
        if not self.e.weight_casts:
            return 0
        blocks = 1 if self.ckpt else self.sh.layers
        if self.float8 is not None:
            return 0 if self.float8.head else 2 * self.sh.head
        return 2 * (blocks * self.sh.block + self.sh.head)

    def tied_grads(self, count: int, grad_bytes: int) -> float:
        """Extra V·h gradients at the end of backward: tied head + embedding gradients and their sum."""
        return count * self.sh.head * grad_bytes if self.sh.tied else 0


def _replicated(r: _Run) -> float:
    return r.sh.params * r.e.weight


def _single(r: _Run) -> list[_Phase]:
    p, e, sh = _replicated(r), r.e, r.sh
    kept = sh.params * e.grad if r.accumulates else 0  # the earlier micro-batches' gradients
    return [
        _Phase("backward start", p + r.weight_casts(), kept, r.optimizer(1), r.activations, r.loss(e.grad)),
        _Phase("backward end", p, sh.params * e.grad, r.optimizer(1), 0, r.tied_grads(2, e.grad)),
    ]


def _ddp(r: _Run) -> list[_Phase]:
    p, e, sh = _replicated(r), r.e, r.sh
    buckets = sh.params * e.grad
    unsynced = sh.params * e.grad if r.accumulates else 0  # no_sync micro-steps' own .grad tensors
    # The last gradients to arrive: three tied V·h tensors, or an untied embedding's, before the copy into a bucket.
    end = r.tied_grads(3, e.grad) if sh.tied else sh.head * e.grad
    return [
        _Phase(
            "backward start",
            p + r.weight_casts(),
            buckets + unsynced,
            r.optimizer(1),
            r.activations,
            r.loss(e.grad),
        ),
        _Phase("backward end", p, buckets, r.optimizer(1), 0, end),
    ]


def _fsdp(r: _Run, *, reshard_after_forward: bool) -> list[_Phase]:
    e, sh, n = r.e, r.sh, r.n
    shards = r.shard * e.weight  # the largest rank's (what must fit), not an even split
    gathered_blocks = min(2, sh.layers) if reshard_after_forward else sh.layers
    gathered = (gathered_blocks * sh.block + sh.root) * e.gathered
    # The root's gradients stay unsharded until the end of backward. With N > 1 they are then copied into a
    # reduce-scatter input; before that, a tied table has two more V·h gradients (head's, embedding's) alive.
    # With N = 1 the unsharded gradient is the shard itself.
    tied = r.tied_grads(2, e.gathered)
    root_end = sh.root * e.gathered + max(tied, sh.root * e.grad) if n > 1 else tied
    if r.offload == "all":
        # CPUOffloadPolicy: shards, their gradients (copied out after each reduce-scatter) and AdamW state live in
        # host memory; the device holds what is gathered and the unsharded gradients before their reduce-scatter.
        host = shards + r.shard_optimizer()
        return [
            _Phase("backward start", gathered, 0, 0, r.activations, r.loss(e.gathered), host=host),
            _Phase("backward end", sh.root * e.gathered, 0, 0, 0, root_end, host=host + r.shard * e.grad),
        ]
    kept = r.shard * e.grad if r.accumulates else 0  # sharded gradients of the step's earlier micro-batches
    phases = [
        _Phase(
            "backward start", shards + gathered, kept, r.shard_optimizer(), r.activations, r.loss(e.gathered)
        ),
        _Phase(
            "backward end",
            shards + sh.root * e.gathered,
            r.shard * e.grad,
            r.shard_optimizer(),
            0,
            root_end,
        ),
    ]
    # No "init" phase: the model is built on meta and each rank allocates only its shards (parallelize), plus one
    # parameter's shard of fp32 values while initialising it (models.common.init), far below the step's peak.
    return phases


def _pipelined(r: _Run) -> list[_Phase]:
    """A pipeline rank (FSDP2 over its data-parallel ranks, `distributed.pipeline`): every block of its stages
    stays gathered from forward to backward (`ParallelPlan.reshard_after_forward`), and their unsharded gradients
    accumulate over the step's micro-batches until the last one's reduce-scatter. Except under GPipe (all forwards
    first), the steady state runs forwards while those gradients exist; the peak is then there."""
    assert r.pipeline is not None
    e, sh = r.e, r.sh
    shards = r.shard * e.weight
    gathered = (sh.layers * sh.block + sh.root) * e.gathered
    unsharded_grads = sh.params * e.gathered
    during = unsharded_grads if r.pipeline.grads_in_flight else 0.0
    name = "steady state" if r.pipeline.grads_in_flight else "backward start"
    return [
        _Phase(name, shards + gathered, during, r.shard_optimizer(), r.activations, r.loss(e.gathered)),
        _Phase("backward end", shards + gathered, unsharded_grads + r.shard * e.grad, r.shard_optimizer()),
    ]


def _build_bytes(e: ElementBytes) -> int:
    return 2 if e.weight == 2 and e.master == 0 else 4  # bf16-true builds in bf16; everything else in fp32


def _zero2(r: _Run) -> list[_Phase]:
    e, sh, n = r.e, r.sh, r.n
    flat = sh.params * e.weight
    partition = sh.params * e.grad / n
    bucket = sh.dim**2 * e.grad  # reduce_bucket_size = h² (distributed/deepspeed.py)
    end = r.tied_grads(2, e.grad) if sh.tied else sh.head * e.grad
    init = max(4 * sh.params, 2 * flat, flat + 4 * sh.params / n)  # fp32 build, flatten copy, master clone
    kept = partition if r.accumulates else 0  # the earlier micro-batches' reduced gradients
    if r.offload == "optimizer":
        # ZeRO-Offload: fp32 master, moments and the fp32 gradient partition on the host, the step on the CPU.
        host = r.optimizer(n) + 4 * sh.params / n
        return [
            _Phase("backward start", flat, 0, 0, r.activations, r.loss(e.grad), host=host),
            _Phase("backward end", flat, bucket, 0, 0, end, host=host),
            _Phase("init", max(4 * sh.params, 2 * flat)),
        ]
    return [
        _Phase("backward start", flat, kept, r.optimizer(n), r.activations, r.loss(e.grad)),
        _Phase("backward end", flat, partition + bucket, r.optimizer(n), 0, end),
        _Phase("optimizer step", flat, partition, r.optimizer(n), 0, 4 * sh.params / n),
        _Phase("init", init),
    ]


def _zero3(r: _Run) -> list[_Phase]:
    e, sh, n = r.e, r.sh, r.n
    partition = sh.params * e.weight / n
    # stage3_max_live_parameters = 24·h² elements (≈ two blocks), never less than the largest module being run (a
    # block, or the V·h head gathered at the start of backward); prefetching (0.9·h²) is off with gloo.
    prefetch = 0 if r.device_kind == "cpu" else int(0.9 * sh.dim**2)
    live = min(sh.params, max(24 * sh.dim**2, sh.block, sh.head) + prefetch) * e.gathered
    grads = sh.params * e.grad / n  # a flat gradient partition kept for the whole run
    sub_group = 4 * min(16 * sh.dim**2, sh.params / n)  # fp32 gradients of one optimizer sub-group
    if r.offload != "none":
        # ZeRO-Offload: fp32 master, moments and gradient partitions on the host (the device keeps one reduce
        # bucket of h² gradients); "all" (offload_param, ZeRO-Infinity) moves the 16-bit partition there too.
        host = r.optimizer(n) + 4 * sh.params / n
        on_device = partition
        if r.offload == "all":
            host, on_device = host + partition, 0
        bucket = sh.dim**2 * e.grad
        return [
            _Phase(
                "backward start", on_device + live, bucket, 0, r.activations, r.loss(e.gathered), host=host
            ),
            _Phase("optimizer step", on_device, 0, 0, 0, 0, host=host),
        ]
    phases = [
        _Phase("backward start", partition + live, grads, r.optimizer(n), r.activations, r.loss(e.gathered)),
        _Phase("optimizer step", partition, grads, r.optimizer(n), 0, sub_group),
    ]
    if r.device_kind == "cpu":  # ZeroStrategy builds the whole model (no zero.Init), then partitions it
        phases.append(_Phase("init", sh.params * _build_bytes(e) + partition + 4 * sh.params / n))
    return phases


_PHASES: dict[str, Callable[[_Run], list[_Phase]]] = {
    "single": _single,
    "ddp": _ddp,
    "fsdp": lambda r: _fsdp(r, reshard_after_forward=True),
    "fsdp_grad_op": lambda r: _fsdp(r, reshard_after_forward=False),
    "deepspeed_zero2": _zero2,
    "deepspeed_zero3": _zero3,
}


def _precision(precision: str, device_kind: str, plan: ParallelPlan) -> str:
    """The precision the run trains in, validated and resolved as the trainer does (`device.plan_device`)."""
    if device_kind not in DEVICE_KINDS:
        raise ConfigError("train.device", f"must be one of {', '.join(DEVICE_KINDS)}, got {device_kind!r}")
    if precision not in PRECISIONS:
        raise ConfigError("train.precision", f"must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        precision = "32-true" if device_kind == "cpu" else "bf16-mixed"
    if precision == "fp8":
        if device_kind != "cuda":
            raise ConfigError("train.precision", "fp8 needs cuda (compute capability >= 8.9); use bf16-mixed")
        # torchao's Float8Linear keeps bf16-mixed's weights, gradients and optimizer state and casts to FP8 inside
        # each matmul, so its memory is bf16-mixed's (its temporary FP8 copies are smaller than the bf16 ones).
        precision = "bf16-mixed"
    if precision == "16-mixed" and (device_kind != "cuda" or plan.shards_parameters):
        raise ConfigError(
            "train.precision",
            "16-mixed needs cuda and a strategy other than fsdp/fsdp_grad_op; use bf16-mixed",
        )
    return precision


def _build_run(
    model: ModelConfig,
    plan: ParallelPlan,
    batch: BatchPlan,
    *,
    precision: str,
    device_kind: str,
    optimizer: str,
) -> tuple[_Run, str, str]:
    """The step to size, with the strategy that runs `plan` on `device_kind` (`ParallelPlan.runs_as`) and the
    resolved precision; what the plans leave to the model (its heads under tensor parallel, its context) checked."""
    if precision == "fp8":  # torchao's defaults (train.fp8_*) unless the run's plan is given
        float8 = plan.float8 or Float8Plan(recipe="tensorwise", head=False, skip_small_linears=False)
    else:
        float8 = None
    precision = _precision(precision, device_kind, plan)
    strategy = plan.runs_as(device_kind)
    if plan.tp_size > 1:
        from gaudi3_scale.train.config import check_tensor_parallel

        check_tensor_parallel(model, plan.tp_size)
    micro = batch.micro_batch_size
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise ConfigError("train.micro_batch_size", f"must be a positive integer, got {micro!r}")
    seq = batch.context_length or model.context_length
    if not 0 < seq <= model.context_length:
        raise ConfigError(
            "model.context_length", f"must be between 1 and the model's {model.context_length}, got {seq}"
        )
    if optimizer not in OPTIMIZER_STATES:
        raise UserInputError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZER_STATES)}")
    whole = model_shape(model)
    run = _Run(
        sh=tp_shape(whole, plan.tp_size),
        whole=whole,
        e=element_bytes(precision, strategy),
        n=plan.dp_shard,  # FSDP shards within one HSDP replica of one tensor-parallel slice; ZeRO over every rank
        b=micro,
        s=seq,
        ckpt=plan.activation_checkpointing,
        device_kind=device_kind,
        states=OPTIMIZER_STATES[optimizer],
        tp=plan.tp_size,
        # On a CPU the host is the device: offloading moves nothing (the CPU run still takes the offload path).
        offload="none" if device_kind == "cpu" else plan.offload,
        compiled=plan.compile,
        float8=float8,
        shard=_largest_shard(model, plan) if plan.shards_parameters and not plan.pipelined else 0.0,
        accumulation=batch.accumulation,
    )
    return run, strategy, precision


def _rank_runs(run: _Run, plan: ParallelPlan, batch: BatchPlan) -> list[_Run]:
    """The step of every pipeline rank (one run without a pipeline): each rank's stages, their parameters sharded
    evenly over its data-parallel ranks (`plan.dp_shard`; FSDP's uneven dim-0 chunks are left out here)."""
    if not plan.pipelined:
        return [run]
    return [
        replace(run, sh=rank.shape, pipeline=rank, shard=rank.shape.params / plan.dp_shard)
        for rank in rank_stages(run.sh, plan, batch.accumulation)
    ]


_SHARDS: dict[tuple[str, str, int, int, int], int] = {}  # the tuner estimates one model many times


def _largest_shard(model: ModelConfig, plan: ParallelPlan) -> int:
    """Parameter elements on the rank FSDP gives the most, from the trainer's own shard plan of a one- and a
    two-block copy built on meta (`models.counting.from_one_and_two_blocks`: blocks shard alike)."""
    key = (repr(model), plan.strategy, plan.world_size, plan.tp_size, plan.dp_replicate)
    if key not in _SHARDS:
        _SHARDS[key] = _plan_largest_shard(model, plan)
    return _SHARDS[key]


def _plan_largest_shard(model: ModelConfig, plan: ParallelPlan) -> int:
    from gaudi3_scale.distributed.shard_plan import parameter_bytes_per_rank

    return max(from_one_and_two_blocks(model, lambda m: parameter_bytes_per_rank(m, plan, element_bytes=1)))


def estimate_memory(
    model: ModelConfig,
    plan: ParallelPlan,
    batch: BatchPlan,
    *,
    precision: str = "auto",
    device_kind: str = "cpu",
    optimizer: str = "adamw",
    pp_rank: int | None = None,
) -> MemoryEstimate:
    """Peak memory per rank of training `model` (vocab_size resolved) as `plan` and `batch` say; see the module
    docstring.

    plan: resolved as a run resolves `parallel.*` (`ParallelPlan.build`, or `RunConfig.parallel_plan`): strategy,
    world_size (all ranks), tp_size, dp_replicate, offload, activation_checkpointing, compile (activations as
    torch.compile saves them) and, with precision fp8, float8 (default: tensorwise, head in bf16). batch: its
    micro_batch_size (sequences per forward pass per rank), context_length (tokens per sequence; 0 = the
    model's, also the maximum) and accumulation (micro-batches per step: above 1, a backward starts with the
    gradients the step's earlier micro-batches left, as the strategy keeps them). `total_bytes` is what the
    tensors and the runtime hold; what a CPU budget is held against adds the allocator's keep: `process_peak_bytes`.
    precision: a `train.precision` value ("auto" = 32-true on cpu, bf16-mixed elsewhere); device_kind: cpu, cuda
    or hpu (one HPU runs as ddp, `ParallelPlan.runs_as`); optimizer: adamw.

    Under pipeline parallel (plan.pp_size > 1) the estimate is of one pipeline rank: `pp_rank`, or by default the
    one whose peak is the largest (named in the estimate's `pp_rank` and `pp_stages`). A rank holds its stages'
    parameters and the activations of the micro-batches its schedule keeps in flight (`tune.pipeline_shape`), so
    there the micro-batch count (batch.accumulation) matters.
    """
    run, strategy, precision = _build_run(
        model, plan, batch, precision=precision, device_kind=device_kind, optimizer=optimizer
    )
    runs = _rank_runs(run, plan, batch)
    if pp_rank is not None and not 0 <= pp_rank < len(runs):
        raise UserInputError(
            f"pp_rank must be between 0 and {len(runs) - 1} (parallel.pp_size - 1), got {pp_rank}"
        )
    by_rank = [(_pipelined(r) if r.pipeline else _PHASES[strategy](r)) for r in runs]
    peaks = [max(phases, key=lambda phase: phase.total) for phases in by_rank]
    chosen = pp_rank if pp_rank is not None else max(range(len(runs)), key=lambda i: peaks[i].total)
    run, phases, peak = runs[chosen], by_rank[chosen], peaks[chosen]
    stages = run.pipeline.stages if run.pipeline else ()
    runtime = 0
    if device_kind == "cpu":
        runtime = CPU_RUNTIME_BYTES + (CPU_DEEPSPEED_IMPORT_BYTES if strategy.startswith("deepspeed") else 0)
    return MemoryEstimate(
        strategy=strategy,
        world_size=plan.world_size,
        micro_batch_size=run.b,
        context_length=run.s,
        precision=precision,
        activation_checkpointing=plan.activation_checkpointing,
        device_kind=device_kind,
        parameters=int(run.whole.params),
        peak_phase=peak.name,
        params_bytes=round(peak.params),
        grads_bytes=round(peak.grads),
        optimizer_bytes=round(peak.optimizer),
        activations_bytes=round(peak.activations),
        workspace_bytes=round(peak.workspace),
        runtime_bytes=runtime,
        tp_size=plan.tp_size,
        dp_replicate=plan.dp_replicate,
        offload=plan.offload,
        host_bytes=round(max(phase.host for phase in phases)),
        compiled=plan.compile,
        pp_size=plan.pp_size,
        pp_schedule=plan.pp_schedule if plan.pipelined else "",
        pp_rank=chosen,
        pp_stages=_stage_indices(plan, chosen) if plan.pipelined else (),
        in_flight_micro_batches=sum(count for _, count in stages) if stages else 1,
    )


def allocator_retained_bytes(estimate: MemoryEstimate, environ: Mapping[str, str] | None = None) -> int:
    """What glibc's allocator keeps resident of what a CPU rank's step frees, on top of `estimate`: a share of it,
    capped (GLIBC_RETAINED_SHARE, GLIBC_RETAINED_MAX_BYTES). 0 off the CPU (the device's allocator is what the
    estimate counts) and when the run's environment (`environ`, default this process's, which a run launched from
    here inherits) sets MALLOC_MMAP_THRESHOLD_, under which glibc hands freed tensors back at once."""
    environ = os.environ if environ is None else environ
    if estimate.device_kind != "cpu" or environ.get(MMAP_THRESHOLD_ENV):
        return 0
    return round(min(estimate.total_bytes * GLIBC_RETAINED_SHARE[0], GLIBC_RETAINED_MAX_BYTES))


def process_peak_bytes(estimate: MemoryEstimate, environ: Mapping[str, str] | None = None) -> int:
    """A rank's peak as a memory budget counts it and a run measures it: on a CPU the process's peak resident set
    (what it takes from the OS, allocator's keep included: `allocator_retained_bytes`), on an accelerator the
    device memory of `estimate.total_bytes`. The number to hold against a budget (`gaudi3 tune`, `gaudi3 plan`)."""
    return estimate.total_bytes + allocator_retained_bytes(estimate, environ)


def _stage_indices(plan: ParallelPlan, pp_rank: int) -> tuple[int, ...]:
    from gaudi3_scale.distributed.stages import local_stages

    return tuple(local_stages(plan.pp_schedule, plan.pp_size, pp_rank))


def estimate_activation_bytes(
    model: ModelConfig,
    plan: ParallelPlan,
    batch: BatchPlan,
    *,
    precision: str = "auto",
    device_kind: str = "cpu",
) -> int:
    """Activations saved for backward per rank at the start of backward (loss workspace not included).

    Without checkpointing: every block's saved tensors plus the final norm and head inputs; with it: each block's
    input, one recomputed block, and the same head-side tensors. The strategy matters only through precision
    (FSDP's bf16 parameters make the residual stream bf16), the ranks only through tensor parallel. Arguments as
    in `estimate_memory`.
    """
    run, _, _ = _build_run(
        model, plan, batch, precision=precision, device_kind=device_kind, optimizer="adamw"
    )
    return round(max(r.activations for r in _rank_runs(run, plan, batch)))


def max_micro_batch_that_fits(
    model: ModelConfig,
    plan: ParallelPlan,
    *,
    budget_bytes: int,
    context_length: int = 0,
    precision: str = "auto",
    device_kind: str = "cpu",
    optimizer: str = "adamw",
    limit: int = 65536,
    accumulation: int = 1,
) -> int:
    """The largest micro-batch (≤ `limit`) whose peak (`process_peak_bytes`) is within `budget_bytes`; 0 when even
    1 does not fit.

    context_length: tokens per sequence (0 = the model's); accumulation: micro-batches per step (1: the
    micro-batch is the rank's whole batch; more keep gradients across micro-steps); other arguments as in
    `estimate_memory` (a pipeline with at least pp_size micro-batches per step, the fewest 1F1B runs; GPipe holds
    all of them). The estimate
    never shrinks as the micro-batch grows, so this doubles, then bisects: O(log limit) estimates, each a few
    milliseconds.
    """

    def fits(micro: int) -> bool:
        batch = BatchPlan.from_micro_batch(
            micro,
            # a pipeline's first stage holds pp_size micro-batches under 1F1B however many more the step has
            accumulation=max(accumulation, plan.pp_size),
            data_parallel_size=plan.data_parallel_size,
            context_length=context_length,
        )
        est = estimate_memory(
            model, plan, batch, precision=precision, device_kind=device_kind, optimizer=optimizer
        )
        return process_peak_bytes(est) <= budget_bytes

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)  # low fits, high does not (or is past the limit)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
