"""Which accelerator spec (and so which MFU peak) a runtime device name gets: only a part the table sources.

"NVIDIA H200" is the SXM part (989 TFLOP/s dense BF16). "NVIDIA H200 NVL" (the PCIe card) and "NVIDIA GH200 …"
also contain "h200" but have no sourced figures in device/accelerators.yaml: they must get no peak (MFU unknown),
not the SXM's, which would understate an NVL's MFU and label it with the SXM's source."""

from __future__ import annotations

import pytest

from gaudi3_scale.device.specs import ACCELERATORS, accelerator_named, find_accelerator


def test_the_h200_sxm_name_torch_reports_gets_the_sxm_peak() -> None:
    spec = find_accelerator("NVIDIA H200")
    assert spec is ACCELERATORS["h200-sxm"] and spec.bf16_dense_tflops == 989.0
    assert accelerator_named("h200") is ACCELERATORS["h200-sxm"]  # the alias users type still works


@pytest.mark.parametrize("device_name", ["NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA H200 PCIe"])
def test_an_h200_variant_the_table_does_not_list_gets_no_peak(device_name: str) -> None:
    assert find_accelerator(device_name) is None
