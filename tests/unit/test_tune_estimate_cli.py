"""`gaudi3 tune --estimate-only`: the memory table for any registry model, without a device or a trial."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from gaudi3_scale.device.specs import ACCELERATORS, accelerator_named
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.models import get_model_config
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.tune.memory import estimate_memory

LAYOUT = re.compile(
    r"^(?P<fits>fits|does not fit)\s+(?P<strategy>\S+) "
    r"(?P<mesh>(?:pp (?P<pp>\d+) \(1f1b\) × )?tp (?P<tp>\d+) × replicate (?P<rep>\d+) × shard \d+"
    r"|over \d+ rank\(s\)(?: \(replicated\))?), "
    r"act\.ckpt (?P<ckpt>on|off), offload (?P<offload>none|optimizer|all): (?P<detail>.*)$"
)


def _layouts(out: str) -> list[re.Match[str]]:
    return [m for m in map(LAYOUT.match, out.splitlines()) if m]


@pytest.mark.parametrize(
    ("accelerator", "device", "gib"), [("h100", "h100-sxm", "74.5"), ("gaudi3", "gaudi3", "119.2")]
)
def test_llama3_70b_layouts_on_64_devices(
    gaudi3_cli: Callable[..., tuple[int, str, str]], accelerator: str, device: str, gib: str
) -> None:
    code, out, err = gaudi3_cli(
        "tune", "--estimate-only", "--model.name", "llama3-70b", "--accelerator", accelerator, "--world-size", "64",
    )  # fmt: skip
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith(f"device: {device}, ")
    assert (
        lines[1].startswith(f"llama3-70b: 70.6 B parameters on 64 × {device} (8 node(s) × 8), ")
        and f"= {gib} GiB per device; micro-batch 1 × 8192 tokens, bf16-mixed" in lines[1]
    )
    layouts = _layouts(out)
    fits = [m for m in layouts if m.group("fits") == "fits"]
    assert f"{len(fits)} of {len(layouts)} layouts fit" in lines[2] and 0 < len(fits) < len(layouts)
    assert [m.group("fits") for m in layouts] == sorted((m.group("fits") for m in layouts), key="fits".__ne__)
    for m in layouts:  # every layout says why it does not fit, in numbers
        if m.group("fits") == "does not fit":
            need = re.match(rf"needs ([\d.]+) GiB per device, the {device} has {gib} GiB", m.group("detail"))
            assert need is not None and float(need.group(1)) > float(gib), m.group(0)
        else:
            used = re.match(r"([\d.]+) GiB per device.*, largest micro-batch (\d+)$", m.group("detail"))
            assert used is not None and float(used.group(1)) <= float(gib) and int(used.group(2)) >= 1
    # ddp replicates 70 B parameters with fp32 AdamW: never fits
    assert all(m.group("fits") == "does not fit" for m in layouts if m.group("strategy") == "ddp")
    # offload is only proposed for a layout that does not fit without it
    by_layout = {
        (m.group("strategy"), m.group("mesh"), m.group("ckpt"), m.group("offload")): m.group("fits")
        for m in layouts
    }
    offloaded = [key for key in by_layout if key[3] != "none"]
    assert offloaded and all(by_layout[(*key[:3], "none")] == "does not fit" for key in offloaded)
    # the first line that fits is checked against the estimator itself
    best = fits[0]
    plan = ParallelPlan.build(
        strategy=best.group("strategy"), world_size=64, activation_checkpointing=best.group("ckpt") == "on",
        tp_size=int(best.group("tp") or 1), dp_replicate=int(best.group("rep") or 1), offload=best.group("offload"),
        pp_size=int(best.group("pp") or 1),
    )  # fmt: skip
    batch = BatchPlan.from_micro_batch(
        1, accumulation=plan.pp_size, data_parallel_size=plan.data_parallel_size
    )
    est = estimate_memory(
        get_model_config("llama3-70b"), plan, batch, precision="bf16-mixed",
        device_kind="hpu" if device == "gaudi3" else "cuda",
    )  # fmt: skip
    assert best.group("detail").startswith(f"{est.total_bytes / 2**30:.1f} GiB per device")
    # … and its overrides make a run config the trainer accepts on 8 nodes of 8
    (given,) = [
        ln.split(": ", 1)[1] for ln in lines if ln.startswith("the first as `gaudi3 train` overrides: ")
    ]
    pairs = [tuple(o[2:].split("=", 1)) for o in given.split()]
    geometry = [("model.name", "llama3-70b"), ("parallel.nproc_per_node", "8"), ("parallel.nnodes", "8"),
                ("parallel.rdzv_endpoint", "node0:29500"), ("train.global_batch_size", "64")]  # fmt: skip
    cfg = build_run_config(None, [*geometry, *pairs])  # type: ignore[list-item]
    assert cfg.parallel_plan().strategy == best.group("strategy")
    strategies = {m.group("strategy") for m in layouts}
    if device == "gaudi3":  # only what the trainer builds on Gaudi
        assert strategies == {"ddp", "fsdp", "fsdp_grad_op"} and "deepspeed" not in "".join(
            m.group(0) for m in layouts
        )
        assert "DeepSpeed is not proposed there" in out
    else:
        assert {"deepspeed_zero2", "deepspeed_zero3"} <= strategies
    assert {m.group("tp") for m in layouts if m.group("tp")} == {
        "1",
        "2",
        "4",
        "8",
    }  # tp: divisors of 8 and of 8 kv heads
    assert {m.group("rep") for m in layouts if m.group("rep")} == {"1", "8"}  # HSDP: one replica per node


def test_llama3_405b_on_16_h100_nodes_proposes_pipeline_layouts(
    gaudi3_cli: Callable[..., tuple[int, str, str]],
) -> None:
    """Pipeline candidates where the ranks and the 126 layers allow (pp 8 and 16 with the Llama 3 split); each says
    what its first stage holds, and its overrides make a run config the trainer accepts."""
    code, out, err = gaudi3_cli(
        "tune", "--estimate-only", "--model.name", "llama3-405b", "--accelerator", "h100", "--world-size", "128",
    )  # fmt: skip
    assert code == 0, out + err
    # the order the listing is in (`LayoutCheck.rank_key`): pipeline stages before tensor-parallel traffic
    assert (
        "then recomputation (+1/3 FLOPs), then pipeline stages (the bubble), then tensor-parallel traffic"
        in out
    )
    layouts = _layouts(out)
    pipelines = [m for m in layouts if m.group("pp")]
    assert {m.group("pp") for m in pipelines} == {"2", "4", "8", "16"}
    fitting = [m for m in pipelines if m.group("fits") == "fits"]
    assert fitting and all(
        m.group("ckpt") == "on" for m in fitting
    )  # 8192 tokens per micro-batch: checkpointing
    first = fitting[0]
    pp, tp = int(first.group("pp")), int(first.group("tp"))
    plan = ParallelPlan.build(strategy=first.group("strategy"), world_size=128, tp_size=tp, pp_size=pp,
                              pp_split=(15, 31, 47, 63, 79, 95, 111) if pp == 8 else
                              tuple(range(7, 120, 8)) if pp == 16 else (), activation_checkpointing=True)  # fmt: skip
    batch = BatchPlan.from_micro_batch(1, accumulation=pp, data_parallel_size=plan.data_parallel_size)
    est = estimate_memory(
        get_model_config("llama3-405b"), plan, batch, precision="bf16-mixed", device_kind="cuda"
    )
    assert first.group("detail").startswith(f"{est.total_bytes / 2**30:.1f} GiB per device")
    # 1F1B: pipeline rank r holds pp − r micro-batches (the Llama 3 split's first stage has one layer fewer, so
    # the largest peak may be the second's)
    assert est.in_flight_micro_batches == pp - est.pp_rank


def test_llama3_70b_on_eight_gaudi3_needs_tensor_parallel_or_offload(
    gaudi3_cli: Callable[..., tuple[int, str, str]],
) -> None:
    code, out, err = gaudi3_cli(
        "tune", "--estimate-only", "--model.name", "llama3-70b", "--world-size", "8", "--accelerator", "gaudi3",
    )  # fmt: skip
    assert code == 0, out + err
    # 16 bytes per parameter of fp32 state over 8 ranks (141 GB) exceed a Gaudi 3 (128 GB) without offload
    fits = [m for m in _layouts(out) if m.group("fits") == "fits"]
    assert fits and all(m.group("offload") == "all" for m in fits)
    assert "host memory per node is not checked" in out


def test_world_size_must_be_whole_nodes(gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, _out, err = gaudi3_cli("tune", "--estimate-only", "--accelerator", "h100", "--world-size", "12")
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert (
        len(lines) == 1
        and "--world-size: 12 is not a whole number of h100-sxm nodes (8 per node)" in lines[0]
    )


def test_a_budget_keeps_the_strategy_table(gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, out, err = gaudi3_cli(
        "tune", "--estimate-only", "--model.name", "llama3-70b", "--world-size", "8", "--accelerator", "gaudi3",
        "--memory-budget", "128GB",
    )  # fmt: skip
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[1].startswith(
        "llama3-70b: 70.6 B parameters, 8 rank(s), micro-batch 1 × 8192 tokens, bf16-mixed"
    )
    rows = {(ln.split()[0], ln.split()[1]): ln for ln in lines[3:13]}
    assert len(rows) == 10 and rows[("ddp", "off")].endswith("no (0)")
    assert "on hpu this codebase trains with ddp, fsdp and fsdp_grad_op" in out


def test_a_budget_overrides_device_memory_and_cpu_is_the_default(
    gaudi3_cli: Callable[..., tuple[int, str, str]],
) -> None:
    code, out, err = gaudi3_cli("tune", "--estimate-only", "--memory-budget", "4GiB")
    assert code == 0, out + err
    # shakespeare-char's vocabulary comes from the bundled, prepared corpus; the micro-batch is the one the run
    # would use (global batch 12 on one rank, micro-batch unset), not 1.
    assert out.startswith(
        "shakespeare-char: 0.804 M parameters, 1 rank(s), micro-batch 12 × 64 tokens, 32-true"
    )
    assert out.splitlines()[0].endswith(", cpu, 4.00 GiB per device")
    assert all(ln.rstrip().endswith(")") for ln in out.splitlines()[2:12])


def test_unknown_accelerator_is_one_line_and_exit_2(gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, _out, err = gaudi3_cli("tune", "--estimate-only", "--accelerator", "tpu-v9")
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--accelerator: unknown accelerator 'tpu-v9'; known: h100-sxm" in lines[0]


def test_accelerator_names_and_prefixes() -> None:
    assert accelerator_named("h100") is ACCELERATORS["h100-sxm"]
    assert accelerator_named("Gaudi3") is ACCELERATORS["gaudi3"]
    assert accelerator_named("NVIDIA H200") is ACCELERATORS["h200-sxm"]
