"""`parallel.rdzv_endpoint`: one grammar (host name, IPv4, bracketed IPv6; port 1-65535), checked when the config is
built, so `--print-config`, `--dry-run` and `train` refuse a bad one alike, in one line, before torch sees it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.hosts import parse_endpoint

CliResult = tuple[int, str, str]


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("node0:29500", ("node0", 29500)),
        ("gpu-a.lab.example.com:1", ("gpu-a.lab.example.com", 1)),
        ("10.0.0.1:65535", ("10.0.0.1", 65535)),
        ("[fd00::1]:29500", ("fd00::1", 29500)),
        ("[::1]:29400", ("::1", 29400)),
    ],
)
def test_good_endpoints_give_host_and_port(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint("parallel.rdzv_endpoint", endpoint) == expected


@pytest.mark.parametrize(
    ("endpoint", "words"),
    [
        ("bad host;x:29500", "got 'bad host;x:29500'"),
        ("node0", "(no port)"),
        (":29500", "got ':29500'"),
        ("fd00::1:29500", "an IPv6 address goes in brackets: [fd00::1]:29500"),
        ("[fe80::1%eth0]:29500", "got '[fe80::1%eth0]:29500'"),
        ("[node0]:29500", "got '[node0]:29500'"),
        ("10.0.0.256:29500", "(not an IPv4 address)"),
        ("-node0:29500", "got '-node0:29500'"),
        ("node0:0", "the port must be 1-65535, got '0'"),
        ("node0:65536", "the port must be 1-65535, got '65536'"),
        ("node0:http", "the port must be 1-65535, got 'http'"),
        ("node0:٢٩٥٠٠", "the port must be 1-65535"),  # Arabic-Indic digits: int() takes them, torch does not
    ],
)
def test_bad_endpoints_say_what_is_wrong_and_what_is_allowed(endpoint: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_endpoint("parallel.rdzv_endpoint", endpoint)
    message = str(info.value)
    assert message.startswith("parallel.rdzv_endpoint: ") and words in message, message
    if "port must be" not in message:
        assert (
            "HOST:PORT (a host name, an IPv4 address or a bracketed IPv6 address, and a port 1-65535)"
            in message
        )


@pytest.mark.parametrize("mode", ["--print-config", "--dry-run", None])
def test_config_check_dry_run_and_train_refuse_a_bad_endpoint_alike(
    mode: str | None, gaudi3_cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """Before: all but train accepted it, and train died in torch's parser with a ValueError traceback."""
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--model.num_layers", "1", "--nproc-per-node", "2"]
    args += ["--rdzv-endpoint", "bad host;x:29500", "--sample-tokens", "0", "--no-progress"]
    code, stdout, err = gaudi3_cli(*args, *([mode] if mode else []))
    assert code == 2 and stdout == "", err
    assert err == (
        "gaudi3: error: parallel.rdzv_endpoint: expected HOST:PORT (a host name, an IPv4 address or a bracketed "
        "IPv6 address, and a port 1-65535), e.g. node0:29500; got 'bad host;x:29500'\n"
    )
    assert not out.exists()


def test_the_rendezvous_timeout_is_a_duration(gaudi3_cli: Callable[..., CliResult]) -> None:
    code, _, err = gaudi3_cli("train", "--print-config", "--parallel.rdzv_timeout_s", "0")
    assert code == 2 and err == "gaudi3: error: parallel.rdzv_timeout_s: must be > 0, got 0.0\n"


@pytest.mark.parametrize(
    ("endpoint", "words"),
    [
        (
            "host:",
            "parallel.rdzv_endpoint: the port must be 1-65535, got '' in 'host:'",
        ),  # YAML: {host: null}
        ("{a: 1}", "parallel.rdzv_endpoint: expected HOST:PORT (a host name"),  # YAML: a mapping
        ("node0:29500 #x", "got '29500 #x' in 'node0:29500 #x'"),  # YAML: a comment, dropped without a word
    ],
)
@pytest.mark.parametrize("verb", [["train", "--print-config"], ["doctor"]])
def test_the_endpoint_flag_is_read_as_typed_not_as_yaml(
    endpoint: str, words: str, verb: list[str], gaudi3_cli: Callable[..., CliResult]
) -> None:
    code, stdout, err = gaudi3_cli(*verb, "--rdzv-endpoint", endpoint)
    assert code == 2 and stdout == "", err
    assert err.startswith("gaudi3: error: ") and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("endpoint", ["node0:29500", "[fd00::1]:29500", "10.0.0.1:65535"])
def test_a_good_endpoint_flag_reaches_the_config_unchanged(
    endpoint: str, gaudi3_cli: Callable[..., CliResult]
) -> None:
    code, stdout, err = gaudi3_cli("train", "--print-config", "--rdzv-endpoint", endpoint)
    assert code == 0, err
    assert yaml.safe_load(stdout)["parallel"]["rdzv_endpoint"] == endpoint
