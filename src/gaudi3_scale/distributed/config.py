"""How a run is spread over processes: strategy, activation checkpointing, and the launch geometry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gaudi3_scale.config.core import check_choice, check_positive
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.hosts import parse_endpoint
from gaudi3_scale.config.numbers import INT32_MAX, MAX_WORLD_SIZE, check_number, check_seconds
from gaudi3_scale.distributed.network import NETWORK_PRESETS

__all__ = [
    "MESH_STRATEGIES",
    "OFFLOAD",
    "OFFLOAD_STRATEGIES",
    "PP_SCHEDULES",
    "STAGES_PER_RANK",
    "STRATEGIES",
    "ParallelConfig",
]

# strategy → what it shards, in ZeRO terms (Rajbhandari et al. 2020, "ZeRO", arXiv:1910.02054):
STRATEGIES = {
    "auto": "ddp when there are several ranks, plain single-device training otherwise",
    "ddp": "replicate everything, all-reduce gradients (ZeRO stage 0)",
    "fsdp": "shard parameters, gradients and optimizer state; re-gather parameters per block (ZeRO-3)",
    "fsdp_grad_op": "shard gradients and optimizer state; keep gathered parameters after forward (ZeRO-2 style)",
    "deepspeed_zero2": "DeepSpeed ZeRO stage 2: shard gradients and optimizer state (needs the deepspeed extra)",
    "deepspeed_zero3": "DeepSpeed ZeRO stage 3: shard parameters too (needs the deepspeed extra)",
}

# `parallel.pp_schedule` → what it does (torch.distributed.pipelining's schedule classes) and its stages per rank.
PP_SCHEDULES = {
    "gpipe": "all forwards, then all backwards (Huang et al. 2019, arXiv:1811.06965); one stage per rank",
    "1f1b": "one forward, one backward in the steady state (Narayanan et al. 2019, PipeDream-Flush); one stage "
    "per rank; needs train accumulation >= pp_size",
    "interleaved_1f1b": "1F1B over two stages per rank placed in a loop (Narayanan et al. 2021, arXiv:2104.04473)",
    "zbv": "zero-bubble V schedule (Qi et al. 2024, arXiv:2401.10241 §6): two stages per rank placed in a V, "
    "weight gradients fill the bubble",
}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}

Strategy = Literal["auto", "ddp", "fsdp", "fsdp_grad_op", "deepspeed_zero2", "deepspeed_zero3"]
Offload = Literal["none", "optimizer", "all"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"]

# What `parallel.offload` moves to host memory, and which strategies can do it:
OFFLOAD = {
    "none": "everything stays on the device",
    "optimizer": "optimizer state and its step on the CPU (DeepSpeed offload_optimizer: deepspeed_zero2, "
    "deepspeed_zero3)",
    "all": "parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy: fsdp, fsdp_grad_op; "
    "DeepSpeed offload_optimizer + offload_param: deepspeed_zero3)",
}
OFFLOAD_STRATEGIES = {
    "optimizer": ("deepspeed_zero2", "deepspeed_zero3"),
    "all": ("fsdp", "fsdp_grad_op", "deepspeed_zero3"),
}
# Tensor parallel and HSDP are device meshes under FSDP2 (ModelParallelStrategy); `auto` picks fsdp for them.
MESH_STRATEGIES = ("auto", "fsdp", "fsdp_grad_op")


@dataclass(kw_only=True)
class ParallelConfig:
    strategy: Strategy = field(
        default="auto", metadata={"help": "; ".join(f"{k}: {v}" for k, v in STRATEGIES.items())}
    )
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "recompute each transformer block's activations in backward"}
    )
    tp_size: int = field(
        default=1,
        metadata={
            "help": "tensor-parallel ranks per model replica (Llama): attention heads, MLP columns, the vocabulary "
            "and (sequence parallel) the context are split over them; must divide nproc_per_node, num_heads, "
            "num_kv_heads, ffn_dim and context_length; 1 = no tensor parallel"
        },
    )
    ep_size: int = field(
        default=1,
        metadata={
            "help": "expert-parallel ranks (mixture of experts: each holds num_experts / ep_size experts); must "
            "divide model.num_experts; only 1 is implemented yet"
        },
    )
    dp_replicate: int = field(
        default=1,
        metadata={
            "help": "HSDP: replicas of the FSDP-sharded model (replicate × shard = world_size / tp_size); "
            "1 = shard over all data-parallel ranks"
        },
    )
    pp_size: int = field(
        default=1,
        metadata={
            "help": "pipeline-parallel ranks: the model's layers are split into consecutive stages, one per rank "
            "(two with interleaved_1f1b or zbv); the first stage also holds the embeddings, the last the final norm "
            "and output head; the train accumulation is the pipeline's micro-batch count; runs on the FSDP2 mesh "
            "(strategy auto, fsdp or fsdp_grad_op), pipeline outermost; 1 = no pipeline (docs/pipeline.md)"
        },
    )
    pp_schedule: PipelineSchedule = field(
        default="1f1b", metadata={"help": "; ".join(f"{k}: {v}" for k, v in PP_SCHEDULES.items())}
    )
    pp_split: list[int] = field(
        default_factory=list,
        metadata={
            "help": "layer indices where pipeline stages 1, 2, … start (stages - 1 increasing indices between 1 "
            "and num_layers - 1; stages = pp_size, or 2 × pp_size with interleaved_1f1b or zbv); empty = the "
            "layers split evenly (num_layers must then divide by the stages)"
        },
    )
    offload: Offload = field(
        default="none", metadata={"help": "; ".join(f"{k}: {v}" for k, v in OFFLOAD.items())}
    )
    nproc_per_node: int = field(default=1, metadata={"help": "processes (ranks) per node"})
    nnodes: int = field(default=1, metadata={"help": "number of nodes"})
    node_rank: int = field(default=0, metadata={"help": "this node's rank, 0 … nnodes-1"})
    rdzv_endpoint: str | None = field(
        default=None,
        metadata={
            "help": "HOST:PORT of the c10d rendezvous (an IPv6 address in brackets: [fd00::1]:29500); null = a "
            "free port on 127.0.0.1 (one node)"
        },
    )
    rdzv_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "seconds a node waits for the rendezvous: for HOST:PORT to accept connections (node 0's "
            "`gaudi3 train` opens it), then for all nodes to join (torchrun's join_timeout, whose default is 600)"
        },
    )
    max_restarts: int = field(
        default=0, metadata={"help": "restarts of the whole worker group after a failure"}
    )
    network_preset: str | None = field(
        default=None,
        metadata={
            "help": "NCCL/HCCL environment variables exported at launch where not already set: "
            + ", ".join(NETWORK_PRESETS)
            + "; null = set nothing (docs/network_presets.md)"
        },
    )

    def __post_init__(self) -> None:
        check_number("nproc_per_node", self.nproc_per_node, low=1, high=INT32_MAX)  # torchrun takes C ints
        check_number("nnodes", self.nnodes, low=1, high=MAX_WORLD_SIZE)
        if self.nproc_per_node * self.nnodes > MAX_WORLD_SIZE:
            raise ConfigError(
                "nnodes" if self.nnodes > 1 else "nproc_per_node",
                f"{self.nnodes:,} nodes × {self.nproc_per_node:,} processes are more than {MAX_WORLD_SIZE:,} ranks",
            )
        check_positive("max_restarts", self.max_restarts, allow_zero=True)
        check_number("tp_size", self.tp_size, low=1, high=INT32_MAX)
        check_number("dp_replicate", self.dp_replicate, low=1, high=INT32_MAX)
        check_number("ep_size", self.ep_size, low=1, high=INT32_MAX)
        check_number("pp_size", self.pp_size, low=1, high=INT32_MAX)
        check_choice("pp_schedule", self.pp_schedule, list(PP_SCHEDULES))
        for index in self.pp_split:
            check_number("pp_split", index, low=1, high=INT32_MAX)
        check_choice("offload", self.offload, list(OFFLOAD))
        if self.network_preset is not None:
            check_choice("network_preset", self.network_preset, sorted(NETWORK_PRESETS))
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                "node_rank", f"must be between 0 and nnodes - 1 ({self.nnodes - 1}), got {self.node_rank}"
            )
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ConfigError("rdzv_endpoint", "is required when nnodes > 1 (HOST:PORT of node 0)")
        if self.rdzv_endpoint is not None:
            parse_endpoint("rdzv_endpoint", self.rdzv_endpoint)
        check_seconds("rdzv_timeout_s", self.rdzv_timeout_s)

        self._check_mesh()

    def _check_mesh(self) -> None:
        """Pipeline and tensor parallel, HSDP and offload against the launch geometry and the strategy."""
        meshed = {"pp_size": self.pp_size, "tp_size": self.tp_size, "dp_replicate": self.dp_replicate}
        field_name = next((name for name, size in meshed.items() if size > 1), None)
        if field_name is not None and self.strategy not in MESH_STRATEGIES:
            raise ConfigError(
                field_name,
                f"runs on an FSDP2 device mesh; allowed with parallel.strategy {', '.join(MESH_STRATEGIES)}, "
                f"not {self.strategy}",
            )
        if self.nproc_per_node % self.tp_size:
            raise ConfigError(
                "tp_size",
                f"must divide nproc_per_node ({self.nproc_per_node}): tensor-parallel ranks talk every layer, so "
                f"they share a node; got {self.tp_size}",
            )
        if (self.world_size // self.tp_size) % self.pp_size:
            raise ConfigError(
                "pp_size",
                f"must divide world_size / tp_size ({self.world_size} / {self.tp_size} = "
                f"{self.world_size // self.tp_size}): every pipeline stage has the same data- and tensor-parallel "
                f"ranks; got {self.pp_size}",
            )
        if self.pp_size == 1 and self.pp_split:
            raise ConfigError("pp_split", "splits the model into pipeline stages: needs pp_size > 1; use []")
        data_parallel = self.data_parallel_size
        if data_parallel % self.dp_replicate:
            raise ConfigError(
                "dp_replicate",
                f"must divide the data-parallel ranks (world_size {self.world_size} / tp_size {self.tp_size}"
                + (f" / pp_size {self.pp_size}" if self.pp_size > 1 else "")
                + f" = {data_parallel}) so that replicate × shard = {data_parallel}; got {self.dp_replicate}",
            )
        if self.offload != "none" and self.strategy not in OFFLOAD_STRATEGIES[self.offload]:
            raise ConfigError(
                "offload",
                f"{self.offload} needs parallel.strategy {', '.join(OFFLOAD_STRATEGIES[self.offload])}, "
                f"not {self.strategy}",
            )

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different data: the world divided into tensor- and pipeline-parallel groups."""
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: pp_size, twice that for the schedules with two stages per rank."""
        return self.pp_size * STAGES_PER_RANK[self.pp_schedule]
