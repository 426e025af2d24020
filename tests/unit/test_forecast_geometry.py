"""The geometry a forecast is of: the config's own ranks (the forecast `gaudi3 train` records for a 1-GPU or 1-HPU
run is one rank, not a catalog node of 8), a full node of `--machine` unless parallel.nproc_per_node is set (then
honoured, or refused above the node), the nodes of parallel.nnodes or --nodes with a placeholder rendezvous, and
the probe's command for a length in epochs. A cuda or hpu run is forecast on this CPU machine from the catalog."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.forecast.run import forecast_config, forecast_for_training, machine_for, run_shape
from gaudi3_scale.train.config import resolve_config

TINY = ["--model.name", "llama-tiny", "--model.vocab_size", "65"]


@pytest.mark.parametrize(("device", "machine"), [("cuda", "h100-sxm"), ("hpu", "gaudi3")])
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_forecast_train_records_is_of_the_configs_own_ranks(
    device: str, machine: str, ranks: int
) -> None:
    cfg = resolve_config(None, [*TINY, "--train.device", device, "--train.global_batch_size", "16",
                                "--train.micro_batch_size", "2", "--parallel.nproc_per_node", str(ranks)])  # fmt: skip
    forecast = forecast_for_training(cfg, cfg.model)
    assert forecast.run["machine"] == machine
    assert forecast.run["world_size"] == ranks  # not the catalog's 8 devices per node
    assert forecast.run["layout"]["strategy"] == ("single" if ranks == 1 else "ddp")
    assert forecast.run["layout"]["accumulation"] == 8 // ranks  # 16 sequences in micro-batches of 2 per rank
    shape = run_shape(cfg, cfg.model, machine_for(cfg, None))
    assert (shape.nodes, shape.ranks_per_node) == (1, ranks)


def test_a_machine_lends_its_whole_node_unless_the_config_sets_its_ranks(tmp_path: Path) -> None:
    common = [*TINY, "--train.global_batch_size", "64"]
    _, full = forecast_config(None, common, machine="h100")
    assert full.run["world_size"] == 8  # no nproc_per_node: a full node of the machine
    _, half = forecast_config(None, [*common, "--parallel.nproc_per_node", "4"], machine="h100")
    assert half.run["world_size"] == 4  # set in the overrides: honoured
    config = tmp_path / "run.yaml"
    config.write_text("parallel:\n  nproc_per_node: 2\n  nnodes: 3\n")
    common = [*TINY, "--train.global_batch_size", "48"]
    cfg, from_file = forecast_config(str(config), common, machine="gaudi3")
    assert (from_file.run["world_size"], cfg.parallel.nnodes) == (6, 3)  # set in the file: honoured
    _, more_nodes = forecast_config(str(config), common, machine="gaudi3", nodes=4)
    assert more_nodes.run["world_size"] == 8  # --nodes over parallel.nnodes, the file's ranks per node kept
    with pytest.raises(ConfigError, match=r"^parallel\.nproc_per_node: 16 ranks per node, but --machine h100 "
                       r"has 8 devices per node; allowed: 1 to 8"):  # fmt: skip
        forecast_config(None, [*common, "--parallel.nproc_per_node", "16"], machine="h100")


def test_several_nodes_of_a_machine_need_no_rendezvous_endpoint_but_keep_the_users(tmp_path: Path) -> None:
    common = [*TINY, "--train.global_batch_size", "64"]
    cfg, forecast = forecast_config(None, [*common, "--parallel.nnodes", "4"], machine="h100")
    assert forecast.run["world_size"] == 32 and cfg.parallel.nnodes == 4  # the documented default of --nodes
    config = tmp_path / "run.yaml"
    config.write_text("parallel:\n  nnodes: 2\n  rdzv_endpoint: node-a:29500\n")
    cfg, forecast = forecast_config(str(config), common, machine="h100")
    assert forecast.run["world_size"] == 16 and cfg.parallel.rdzv_endpoint == "node-a:29500"


def test_machine_cpu_forecasts_this_cpu_whatever_train_device_says() -> None:
    cfg, forecast = forecast_config(None, [*TINY, "--train.device", "cuda"], machine="cpu")
    assert forecast.run["machine"] == "cpu" and forecast.run["world_size"] == 1
    assert cfg.train.device == "cuda"  # the config is forecast as it is, on the machine asked for


def test_a_probe_of_a_single_machine_refuses_several_nodes() -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.nnodes: 2: --probe runs on this machine, one node"):
        forecast_config(None, [*TINY, "--parallel.nnodes", "2"], probe=True)


def test_the_probe_command_of_an_epoch_based_config_is_accepted_by_train(tmp_path: Path) -> None:
    """The probe sets its own length in steps and unsets the user's max_epochs (from a file or an override), which
    train would otherwise refuse beside it."""
    from gaudi3_scale.forecast.probe import probe_command

    config = tmp_path / "epochs.yaml"
    config.write_text("model:\n  name: llama-tiny\ntrain:\n  max_epochs: 2\n")
    command = probe_command(str(config), ("--train.max_epochs", "1"), tmp_path / "probe", warmup_steps=2,
                            measured_steps=10)  # fmt: skip
    done = subprocess.run([*command, "--print-config"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert command[:4] == [sys.executable, "-m", "gaudi3_scale.cli", "train"]
    assert "  max_steps: 12\n" in done.stdout and "  max_epochs: null\n" in done.stdout


@pytest.fixture
def a_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """This CPU machine seen as one with a visible CUDA device (no GPU runs here); the name is the test's to set."""
    import torch

    name = ["NVIDIA A100-SXM4-80GB"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name[0])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return name


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_gpu_run_is_forecast_on_this_machines_gpu_with_its_ranks(
    a_visible_gpu: list[str], device: str
) -> None:
    cfg = resolve_config(None, [*TINY, "--train.device", device])
    forecast = forecast_for_training(cfg, cfg.model)
    assert (forecast.run["machine"], forecast.run["world_size"]) == ("a100-sxm", 1)  # not h100, not 8 ranks


def test_an_uncatalogued_gpu_is_one_line_naming_the_way_out(a_visible_gpu: list[str]) -> None:
    from gaudi3_scale.config.errors import UserInputError

    a_visible_gpu[0] = "NVIDIA GeForce GTX 1080"
    cfg = resolve_config(None, [*TINY, "--train.device", "cuda"])
    with pytest.raises(UserInputError, match=r"^train\.device: this machine's GPU 'NVIDIA GeForce GTX 1080' has no "
                       r"catalogued peak FLOP/s to forecast with; forecast a catalogued one with --machine \(a100"):  # fmt: skip
        machine_for(cfg, None)


def test_a_saved_config_that_nulls_the_endpoint_is_forecast_on_several_nodes(tmp_path: Path) -> None:
    """Every config.yaml a run saves says `rdzv_endpoint: null`, which the placeholder under it did not replace:
    `--config runs/x/config.yaml --machine h100 --nodes 2` asked for a rendezvous host a forecast never contacts."""
    saved = tmp_path / "config.yaml"
    saved.write_text(
        "model:\n  name: llama-tiny\n  vocab_size: 65\ntrain:\n  global_batch_size: 16\n"
        "parallel:\n  rdzv_endpoint: null\n"
    )
    cfg, forecast = forecast_config(str(saved), [], machine="h100", nodes=2)
    assert forecast.run["nodes"] == 2 and cfg.parallel.nnodes == 2
    _, again = forecast_config(str(saved), ["--parallel.rdzv_endpoint", "null"], machine="h100", nodes=2)
    assert again.run["nodes"] == 2
    cfg, _ = forecast_config(str(saved), ["--parallel.rdzv_endpoint", "node0:29500"], machine="h100", nodes=2)
    assert cfg.parallel.rdzv_endpoint == "node0:29500"  # the user's own is kept


@pytest.mark.parametrize(
    ("machine", "instance", "message"),
    [
        ("h100", "aws/p5.4xlarge/us-east-1", r"^cost.instance: aws/p5.4xlarge/us-east-1 has 1 h100-sxm per node, "
         r"but the forecast runs 8 ranks per node; pick an instance with at least 8"),
        ("gaudi3", "aws/p5.48xlarge/us-east-1", r"^cost.instance: aws/p5.48xlarge/us-east-1 is a node of h100-sxm, "
         r"but the forecast is of gaudi3; pick an instance of gaudi3 or set cost.price_usd_per_hour"),
        ("h100", "aws/p4d.24xlarge/us-east-1", r"is a node of a100-sxm-40gb, but the forecast is of h100-sxm"),
    ],
)  # fmt: skip
def test_a_machine_is_priced_only_by_an_instance_of_it(machine: str, instance: str, message: str) -> None:
    """8 H100 ranks priced as one 1-GPU p5.4xlarge ($13 instead of $106), a Gaudi 3 at an H100 node's price."""
    common = [*TINY, "--train.global_batch_size", "64", "--cost.instance", instance]
    with pytest.raises(ConfigError, match=message):
        forecast_config(None, common, machine=machine)
    _, priced = forecast_config(None, [*TINY, "--train.global_batch_size", "64", "--cost.instance",
                                       "aws/p5.48xlarge/us-east-1"], machine="h100")  # fmt: skip
    assert priced.cost_usd.value is not None and priced.cost_usd.value > 0
    _, theirs = forecast_config(None, [*common, "--cost.price_usd_per_hour", "10"], machine=machine)
    assert theirs.cost_usd.value is not None  # an explicit price per node is the user's, taken as given
