"""The catalog: accelerator specs (device/accelerators.yaml) and instance prices (metering/instances.yaml), sourced."""

from __future__ import annotations

from pathlib import Path

import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.device.specs import ACCELERATORS, accelerator_named, find_accelerator
from gaudi3_scale.metering.catalog import load_instances


def test_accelerator_specs_carry_sources_and_the_published_numbers() -> None:
    names = {"h100-sxm", "h200-sxm", "a100-sxm", "a100-sxm-40gb", "gaudi2", "gaudi3", "mi300x"}
    assert set(ACCELERATORS) == names
    for spec in ACCELERATORS.values():
        assert spec.source and spec.bf16_dense_tflops > 0 and spec.memory_gb > 0
    g3 = ACCELERATORS["gaudi3"]
    assert (g3.bf16_dense_tflops, g3.memory_gb, g3.memory_bandwidth_tbps, g3.tdp_w) == (
        1677.0,
        128.0,
        3.67,
        900,
    )
    assert "Hot Chips" in g3.source and "1600 MHz" in g3.source
    assert ACCELERATORS["a100-sxm"].fp8_dense_tflops is None  # no FP8 on A100: absent, not a number
    assert find_accelerator("NVIDIA H100 80GB HBM3") is ACCELERATORS["h100-sxm"]
    assert find_accelerator("Intel Gaudi 3") is ACCELERATORS["gaudi3"]
    assert find_accelerator("Some Unknown GPU") is None
    # torch's names for the two A100 SXM parts: the 40 GB one must not be taken for the 80 GB one
    assert find_accelerator("NVIDIA A100-SXM4-40GB") is ACCELERATORS["a100-sxm-40gb"]
    assert find_accelerator("NVIDIA A100-SXM4-80GB") is ACCELERATORS["a100-sxm"]
    a40 = ACCELERATORS["a100-sxm-40gb"]
    assert (a40.memory_gb, a40.memory_bandwidth_tbps, a40.tdp_w) == (40.0, 1.555, 400)
    assert a40.bf16_dense_tflops == 312.0
    assert accelerator_named("a100") is ACCELERATORS["a100-sxm"]
    assert accelerator_named("A100-40GB") is ACCELERATORS["a100-sxm-40gb"]
    assert accelerator_named("h100") is ACCELERATORS["h100-sxm"]


def test_shipped_instances_are_sourced_and_unknown_prices_stay_unknown() -> None:
    instances = load_instances()
    p5 = instances[("aws", "p5.48xlarge", "us-east-1")]
    assert p5.accelerator == "h100-sxm" and p5.accelerators_per_node == 8
    assert p5.on_demand_usd_per_hour == 55.04 and p5.capacity_block_usd_per_hour == 39.33
    assert p5.spot_usd_per_hour_range == (10.24, 55.04)
    assert "skypilot-catalog" in p5.source and p5.prices_date
    single = instances[("aws", "p5.4xlarge", "us-east-1")]
    assert single.spot_usd_per_hour_range is None and single.capacity_block_usd_per_hour is None
    for inst in instances.values():
        assert inst.source and inst.prices_date and inst.accelerator in ACCELERATORS
    # No sourced Gaudi instance price exists: none is listed (and the seed's "$32.77/h" was an A100 p4d price).
    assert not [i for i in instances.values() if i.accelerator.startswith("gaudi")]
    assert all(i.on_demand_usd_per_hour != 32.77 for i in instances.values())


USER = """
sources:
  mine: our 2026 contract, page 3
instances:
  - provider: aws
    type: p5.48xlarge
    accelerator: h100-sxm
    accelerators_per_node: 8
    region: us-east-1
    on_demand_usd_per_hour: 40.0
    spot_usd_per_hour_range: null
    capacity_block_usd_per_hour: null
    prices_date: "2026-11-01"
    sources: [mine]
  - provider: onprem
    type: gaudi3-node
    accelerator: gaudi3
    accelerators_per_node: 8
    region: dc1
    on_demand_usd_per_hour: null
    spot_usd_per_hour_range: null
    capacity_block_usd_per_hour: null
    prices_date: "2026-11-01"
    sources: [mine]
"""


def test_a_user_file_overrides_and_extends(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(USER)
    instances = load_instances(path)
    assert instances[("aws", "p5.48xlarge", "us-east-1")].on_demand_usd_per_hour == 40.0
    assert instances[("aws", "p5.48xlarge", "us-east-1")].source == "our 2026 contract, page 3"
    assert instances[("onprem", "gaudi3-node", "dc1")].on_demand_usd_per_hour is None
    assert ("aws", "p5en.48xlarge", "us-east-1") in instances  # the shipped rest is kept


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("accelerator: gaudi3", "accelerator: gaudi9"),
            "instances[1] (onprem gaudi3-node): accelerator 'gaudi9' is not",
        ),
        (
            ("on_demand_usd_per_hour: 40.0", "on_demand_usd_per_hour: -1"),
            "instances[0] (aws p5.48xlarge): on_demand_usd",
        ),
        (("    region: dc1\n", ""), "instances[1] (onprem gaudi3-node): missing field(s) region"),
        (
            ("    sources: [mine]\n  - provider", "    sources: [theirs]\n  - provider"),
            "sources must list keys",
        ),
        (
            ("accelerators_per_node: 8\n    region: dc1", "accelerators_per_node: 0\n    region: dc1"),
            "accelerators_per_node must be an integer from 1 to 1024, got 0",
        ),
        (("instances:", "instances: [\n"), "not valid YAML"),
    ],
)
def test_a_malformed_override_is_one_line_naming_the_entry(
    tmp_path: Path, edit: tuple[str, str], message: str
) -> None:
    path = tmp_path / "mine.yaml"
    assert edit[0] in USER
    path.write_text(USER.replace(edit[0], edit[1], 1))
    with pytest.raises(UserInputError) as info:
        load_instances(path)
    text = str(info.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text
    with pytest.raises(UserInputError, match=r"catalog file .*absent\.yaml' does not exist"):
        load_instances(tmp_path / "absent.yaml")
