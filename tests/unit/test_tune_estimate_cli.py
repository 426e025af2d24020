"""`gaudi3 tune --estimate-only`: the memory table for any registry model, without a device or a trial."""

from __future__ import annotations

from collections.abc import Callable

from gaudi3_scale.device.specs import ACCELERATORS, accelerator_named
from gaudi3_scale.models import get_model_config
from gaudi3_scale.tune.memory import estimate_memory


def test_llama3_70b_on_eight_gaudi3(gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, out, err = gaudi3_cli(
        "tune", "--estimate-only", "--model.name", "llama3-70b", "--world-size", "8", "--accelerator", "gaudi3",
    )  # fmt: skip
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith(
        'device: gaudi3, 128 GB (source: Intel, "Intel Gaudi 3 AI Accelerator" (R. Kaplan), Hot Chips'
    )
    assert lines[1].startswith(
        "llama3-70b: 70.6 B parameters, 8 rank(s), micro-batch 1 × 8192 tokens, bf16-mixed"
    )
    rows = {(ln.split()[0], ln.split()[1]): ln for ln in lines[3:13]}
    assert len(rows) == 10  # 5 strategies × activation checkpointing off/on
    fsdp = estimate_memory(
        get_model_config("llama3-70b"),
        strategy="fsdp",
        world_size=8,
        precision="bf16-mixed",
        activation_checkpointing=True,
        device_kind="hpu",
    )
    assert f"{fsdp.total_bytes / 2**30:.2f}" in rows[("fsdp", "on")].split()
    # DDP replicates 70 B parameters with fp32 AdamW: ~1.1 TB per rank never fits a 128 GB device.
    assert rows[("ddp", "off")].endswith("no (0)")
    assert "on hpu this codebase trains with ddp only" in out


def test_a_budget_overrides_device_memory_and_cpu_is_the_default(
    gaudi3_cli: Callable[..., tuple[int, str, str]],
) -> None:
    code, out, err = gaudi3_cli("tune", "--estimate-only", "--memory-budget", "4GiB")
    assert code == 0, out + err
    # shakespeare-char's vocabulary comes from the bundled, prepared corpus.
    assert out.startswith(
        "shakespeare-char: 0.804 M parameters, 1 rank(s), micro-batch 1 × 64 tokens, 32-true"
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
