"""Spot-price settings that would have no effect, or that name an unknown provider, are refused in one line that
names the field at fault, as the spot policy's thresholds are; a zone the provider cannot use names
cost.spot_availability_zone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.metering.live import check_cost_config
from gaudi3_scale.train.config import build_run_config

AWS = ["--cost.instance", "aws/p5.48xlarge/us-east-1"]
AZURE = ["--cost.instance", "azure/Standard_ND96isr_H100_v5/eastus", "--cost.price_usd_per_hour", "30"]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ([*AWS, "--cost.spot_provider", "nope"],
         "cost.spot_provider: applies only with cost.pricing spot, but pricing is 'on_demand'"),
        ([*AWS, "--cost.spot_provider", "azure"], "cost.spot_provider: applies only with cost.pricing spot"),
        ([*AWS, "--cost.spot_availability_zone", "us-east-1z"],
         "cost.spot_availability_zone: applies only with cost.pricing spot"),
        ([*AWS, "--cost.spot_endpoint_url", "http://127.0.0.1:1/"],
         "cost.spot_endpoint_url: applies only with cost.pricing spot"),
        ([*AWS, "--cost.pricing", "capacity_block", "--cost.spot_ttl_s", "60"],
         "cost.spot_ttl_s: applies only with cost.pricing spot, but pricing is 'capacity_block'"),
        (["--cost.price_usd_per_hour", "10", "--cost.pricing", "spot", "--cost.spot_provider", "azure"],
         "cost.instance: cost.spot_provider applies to live spot quotes, which need an instance"),
    ],
)  # fmt: skip
def test_spot_settings_that_would_be_ignored_are_refused(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_run_config(None, parse_overrides(overrides))
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)


def test_the_defaults_and_a_spot_run_pass() -> None:
    build_run_config(None, parse_overrides(AWS))
    cfg = build_run_config(None, parse_overrides([*AWS, "--cost.pricing", "spot", "--cost.spot_provider", "aws",
                                                  "--cost.spot_availability_zone", "us-east-1a"]))  # fmt: skip
    check_cost_config(cfg.cost)


def _check(*overrides: str) -> None:
    check_cost_config(build_run_config(None, parse_overrides(["--cost.pricing", "spot", *overrides])).cost)


def test_an_unknown_provider_names_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"^cost\.spot_provider: unknown spot price provider 'nope'; known: .*aws"
    ):
        _check(*AWS, "--cost.spot_provider", "nope")


def test_a_zone_the_provider_cannot_use_names_the_zone_field() -> None:
    with pytest.raises(
        ConfigError, match=r"^cost\.spot_availability_zone: azure prices a VM size per region"
    ):
        _check(*AZURE, "--cost.spot_provider", "azure", "--cost.spot_availability_zone", "eastus-1")
    with pytest.raises(
        ConfigError, match=r"^cost\.spot_provider: unknown spot price provider"
    ):  # the name first
        _check(*AZURE, "--cost.spot_provider", "azur", "--cost.spot_availability_zone", "eastus-1")


def test_cli_refuses_an_ignored_provider_in_one_line(tmp_path: object) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(tmp_path), *AWS,
         "--cost.spot_provider", "nope"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr == (
        "gaudi3: error: cost.spot_provider: applies only with cost.pricing spot, but pricing is 'on_demand'\n"
    )
