"""`gaudi3 cost compare` / CostAnalyzer: estimates against hand computations (the step as `gaudi3 plan`'s model
gives it: compute with recomputation, plus the communication the backward pass does not hide), unknown prices,
reports, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.cost import CostAnalyzer, compare_training_cost
from gaudi3_scale.cost.estimate import DEFAULT_PUE, Assumptions, parse_count
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.models import get_model_config
from gaudi3_scale.tune.memory import estimate_memory

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "benchmark_cpu_small"

# Llama 3 70B by hand (Meta's published shape): 80 layers, model dim 8192, 64 query heads of 128, 8 kv heads,
# SwiGLU hidden 28672, vocabulary 128256, untied input embedding (a lookup: not a matmul) and output head.
L, D, HEADS, KV, HD, FFN, V, T = 80, 8192, 64, 8, 128, 28672, 128256, 8192
PER_LAYER = D * D + 2 * D * KV * HD + D * D + 3 * D * FFN + 2 * D  # q, k+v, o, SwiGLU, two RMSNorms
N_MATMUL = L * PER_LAYER + D + D * V  # + final norm + output head
FLOPS_PER_TOKEN = 6 * N_MATMUL + 12 * L * HEADS * HD * T  # PaLM App. B: 6N + attention
HEAD_FLOPS_PER_TOKEN = 6 * D * V  # the output head's part of it: never checkpointed, so never recomputed
# Under activation checkpointing each block's forward (a third of its FLOPs) runs again in backward; the head's not.
RECOMPUTED_FLOPS_PER_TOKEN = FLOPS_PER_TOKEN + (FLOPS_PER_TOKEN - HEAD_FLOPS_PER_TOKEN) / 3
N_ALL = N_MATMUL + D * V  # + the input embedding: what FSDP gathers and reduces
H100_PEAK = 989.4e12  # NVIDIA H100 SXM dense BF16 (datasheet)
P5_USD_PER_HOUR = 55.04  # p5.48xlarge on-demand us-east-1 (SkyPilot catalog snapshot), 8 × H100
P5_EFA_BYTES_PER_S = 3200e9 / 8  # 3,200 Gbps of EFA per p5 node (forecast/links.yaml), shared by its 8 ranks


def _h100_step_s(devices: int, mfu: float) -> float:
    """One step of one sequence of T tokens per rank under FSDP with activation checkpointing, by hand: the
    FLOPs per rank (each block's forward again: RECOMPUTED_FLOPS_PER_TOKEN) over peak × MFU; FSDP's two bf16 all-gathers and one fp32
    reduce-scatter per step over the node's EFA share, less what hides behind the backward pass (2/3 of compute)."""
    compute = RECOMPUTED_FLOPS_PER_TOKEN * T / (H100_PEAK * mfu)
    comm = (devices - 1) / devices * N_ALL * (2 * 2 + 4) / (P5_EFA_BYTES_PER_S / 8)
    return compute + max(0.0, comm - 2 / 3 * compute)


def test_llama3_70b_on_h100_matches_the_hand_computation() -> None:
    assert N_MATMUL == 69_503_033_344
    comparison = compare_training_cost("llama3-70b", "1T", ["h100"], mfu=0.40)
    assert comparison.flops_per_token == FLOPS_PER_TOKEN
    assert comparison.training_flops == FLOPS_PER_TOKEN * 1e12
    row = comparison.rows[0]
    # Fit: ZeRO-3 over 16 H100s is over 95 % of 80 GB per device, over 32 it is under → 4 nodes of 8.
    budget = 0.95 * 80e9
    per_device = {
        n: estimate_memory(get_model_config("llama3-70b"),
                           ParallelPlan.build(strategy="fsdp", world_size=n, activation_checkpointing=True),
                           BatchPlan.from_micro_batch(1, data_parallel_size=n), precision="bf16-mixed",
                           device_kind="cuda").total_bytes
        for n in (16, 32)
    }  # fmt: skip
    assert per_device[16] > budget >= per_device[32]
    assert (row.min_accelerators, row.nodes, row.per_node, row.accelerators) == (32, 4, 8, 32)
    # Time: 1T tokens in steps of 32 sequences of 8,192 tokens; a step of 13.24 s of compute and 10.94 s of
    # gradient and parameter traffic, 2.11 s of it not hidden behind the backward pass.
    assert row.tokens_per_step == 32 * T
    assert row.step_time_s == pytest.approx(_h100_step_s(32, 0.40), rel=1e-12)
    assert row.step_time_s == pytest.approx(15.350, abs=1e-3)
    hours = 1e12 / (32 * T) * _h100_step_s(32, 0.40) / 3600
    assert row.train_hours == pytest.approx(hours, rel=1e-12)
    assert row.train_hours == pytest.approx(16_265.95, abs=0.01)  # ≈ 678 days on 32 GPUs
    assert row.step_time_source is not None and "compute 13.24 s" in row.step_time_source
    assert "communication 2.107 s" in row.step_time_source and "3,200 Gbps" in row.step_time_source
    assert row.accelerator_hours == pytest.approx(hours * 32, rel=1e-12)
    assert row.on_demand_usd == pytest.approx(hours * 4 * P5_USD_PER_HOUR, rel=1e-12)
    assert row.on_demand_usd == pytest.approx(3_581_111, rel=1e-6)
    assert row.spot_usd_low == pytest.approx(hours * 4 * 10.24, rel=1e-12)
    assert row.spot_usd_high == pytest.approx(hours * 4 * 55.04, rel=1e-12)
    assert row.capacity_block_usd == pytest.approx(hours * 4 * 39.33, rel=1e-12)
    assert row.usd_per_million_tokens == pytest.approx(row.on_demand_usd / 1e6, rel=1e-12)
    assert row.tokens_per_usd == pytest.approx(1e12 / row.on_demand_usd, rel=1e-12)
    # Energy: 32 GPUs × 700 W × hours × PUE 1.58; no $ without an electricity price.
    assert row.energy_kwh == pytest.approx(32 * 700 * hours * DEFAULT_PUE / 1000, rel=1e-12)
    assert row.energy_usd is None


def test_more_nodes_shorten_the_run_and_cost_what_their_traffic_adds() -> None:
    four, eight = (
        compare_training_cost("llama3-70b", "1T", ["h100"], mfu=0.4, nodes=n).rows[0] for n in (4, 8)
    )
    # Twice the devices: half the steps, each a little longer (63/64 of the parameters cross the network, not 31/32).
    assert eight.accelerators == 64 and eight.step_time_s == pytest.approx(_h100_step_s(64, 0.4), rel=1e-12)
    assert eight.step_time_s > four.step_time_s  # type: ignore[operator]
    ratio = eight.step_time_s / four.step_time_s  # type: ignore[operator]
    assert eight.train_hours == pytest.approx(four.train_hours / 2 * ratio)
    assert eight.on_demand_usd == pytest.approx(four.on_demand_usd * ratio)
    too_few = compare_training_cost("llama3-70b", "1T", ["h100", "mi300x"], mfu=0.4, nodes=1).rows
    assert not too_few[0].fits and "needs at least 32 devices" in too_few[0].note
    assert too_few[1].fits  # 8 × 192 GB hold it


def test_unknown_prices_stay_unknown(gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    row = compare_training_cost("llama3-70b", "1T", ["gaudi3"], mfu=0.4).rows[0]
    assert row.fits and row.train_hours is not None  # time is known, price is not
    assert row.instance is None and "price unknown" in row.note
    assert (row.on_demand_usd, row.spot_usd_low, row.capacity_block_usd, row.usd_per_million_tokens) == (
        None,
        None,
        None,
        None,
    )
    code, out, _ = gaudi3_cli("cost", "compare", "--model", "llama3-70b", "--tokens", "1T", "--platforms",
                              "gaudi3,h100", "--mfu", "0.40")  # fmt: skip
    assert code == 0
    money = next(line for line in out.splitlines() if line.startswith("│ gaudi3") and "unknown" in line)
    assert "$" not in money and money.count("unknown") >= 5
    assert "$3.58M" in out  # the H100 row is priced


def test_a_user_catalog_prices_gaudi3(tmp_path: Path) -> None:
    catalog = tmp_path / "mine.yaml"
    catalog.write_text(
        "sources:\n  quote: our vendor quote (test fixture)\ninstances:\n"
        "  - {provider: onprem, type: hls-gaudi3, accelerator: gaudi3, accelerators_per_node: 8, region: lab,\n"
        "     on_demand_usd_per_hour: 40.0, spot_usd_per_hour_range: null, capacity_block_usd_per_hour: null,\n"
        "     prices_date: 2026-11, sources: [quote]}\n"
    )
    row = compare_training_cost("llama3-70b", "1T", ["gaudi3"], mfu=0.4, catalog_file=catalog).rows[0]
    # 16 Gaudi 3 at 1,677 TFLOP/s × 0.4; 600 GB/s of scale-out per 8-device box (forecast/links.yaml)
    compute = RECOMPUTED_FLOPS_PER_TOKEN * T / (1677e12 * 0.4)
    comm = 15 / 16 * N_ALL * (2 * 2 + 4) / (600e9 / 8)
    hours = 1e12 / (16 * T) * (compute + max(0.0, comm - 2 / 3 * compute)) / 3600
    assert row.train_hours == pytest.approx(hours, rel=1e-12)
    assert row.accelerators == 16 and row.instance == "onprem hls-gaudi3 lab"
    assert row.on_demand_usd == pytest.approx(hours * 2 * 40.0, rel=1e-12)


def test_malformed_catalog_override_is_one_line_exit_2(
    tmp_path: Path, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    catalog = tmp_path / "bad.yaml"
    catalog.write_text(
        "sources:\n  q: quote\ninstances:\n"
        "  - {provider: aws, type: p5.48xlarge, accelerator: h100-sxm, accelerators_per_node: 8, region: us-east-1,\n"
        "     on_demand_usd_per_hour: -3, spot_usd_per_hour_range: null, capacity_block_usd_per_hour: null,\n"
        "     prices_date: x, sources: [q]}\n"
    )
    code, out, err = gaudi3_cli(
        "cost", "compare", "--model", "llama3-70b", "--tokens", "1T", "--catalog", str(catalog)
    )
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1
    assert "instances[0] (aws p5.48xlarge)" in lines[0] and "on_demand_usd_per_hour" in lines[0]


def test_a_model_that_fits_nowhere_is_one_clear_line(gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    with pytest.raises(UserInputError, match=r"fits on none of h100, a100: h100: even on 65,536 devices"):
        compare_training_cost("llama3-8b", "1T", ["h100", "a100"], context_length=4_000_000)
    code, out, err = gaudi3_cli("cost", "compare", "--model", "llama3-8b", "--tokens", "1T", "--platforms",
                                "h100,a100", "--context-length", "4000000")  # fmt: skip
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "fits on none of h100, a100" in err and "activations of micro-batch 1" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--tokens", "lots"), "--tokens: expected a number with an optional K, M, B, T suffix"),
        (("--tokens", "-1T"), "--tokens: expected a number with an optional K, M, B, T suffix"),
        (("--tokens", "nan"), "--tokens: expected a number with an optional K, M, B, T suffix"),
        (("--tokens", "inf"), "--tokens: expected a number with an optional K, M, B, T suffix"),
        (("--tokens", "1T", "--platforms", "tpu9"), "--platforms: unknown accelerator 'tpu9'"),
        (("--tokens", "1T", "--mfu", "1.5"), "--mfu: must be in (0, 1]"),
        (
            ("--tokens", "1T", "--mfu", "0.4", "--from-benchmarks", "."),
            "--mfu and --from-benchmarks are exclusive",
        ),
        (("--tokens", "1T", "--nodes", "0"), "--nodes: must be a positive integer"),
        (("--tokens", "1T", "--pue", "-1"), "--pue: must be a finite number >= 1"),  # facility ÷ IT energy
    ],
)
def test_bad_input_is_one_line_exit_2(
    args: tuple[str, ...], expected: str, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    code, out, err = gaudi3_cli("cost", "compare", "--model", "llama3-70b", *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and expected in err


def test_unknown_model_names_the_presets() -> None:
    with pytest.raises(UserInputError, match=r"--model: '13B' is not a model preset.*llama3-70b"):
        compare_training_cost("13B", "1T", ["h100"])


def test_a_platforms_string_is_one_name_or_the_clis_comma_list_never_its_characters() -> None:
    analyzer = CostAnalyzer()
    one = analyzer.compare_training_cost(model_size="8B", dataset_tokens="1B", platforms="gaudi3")
    assert [r.platform for r in one.rows] == ["gaudi3"]
    two = compare_training_cost("8B", "1B", "gaudi3, h100")
    assert [r.platform for r in two.rows] == ["gaudi3", "h100"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_size": 70e9}, r"^--model: expected a preset name .*, got 70000000000.0$"),
        ({"model_size": None}, r"^--model: expected a preset name .*, got None$"),
        ({"mfu": "0.4"}, r"^--mfu: must be in \(0, 1\], got '0.4'$"),
        ({"mfu": True}, r"^--mfu: must be in \(0, 1\], got True$"),
    ],
)
def test_cost_analyzer_refuses_a_wrong_typed_argument_in_one_line(kwargs: dict, message: str) -> None:
    args = {"model_size": "8B", "dataset_tokens": "1B", "platforms": ["gaudi3"], **kwargs}
    with pytest.raises(UserInputError, match=message):
        CostAnalyzer().compare_training_cost(**args)


# Issue 36 item 7: a count below one token, a fraction of a token, or beyond 64 bits printed a table ($0.00 and
# 0.0 days for 1e-300; inf days for 1e300) and exited 0.
@pytest.mark.parametrize(
    "tokens", ["1e-300", "0.5", "1.5", "0", "0K", "2.5e-4K", "1e300", "1e19", "1e99999999999999999999"]
)
def test_tokens_must_be_a_whole_count_of_at_least_one(
    tokens: str, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    code, out, err = gaudi3_cli("cost", "compare", "--model", "llama3-70b", "--tokens", tokens)
    assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
    assert (
        err.startswith("gaudi3: error: --tokens: must be a whole number of tokens from 1 to ") and "1T" in err
    ), err
    assert err.rstrip().endswith(f"got {tokens!r}"), err


def test_parse_count() -> None:
    # The documented forms (1T, 300B, 2.5e12, an integer) and a suffix on a decimal: whole counts, exactly.
    assert (
        parse_count("1T", "x") == 1e12
        and parse_count("300b", "x") == 3e11
        and parse_count("2.5e12", "x") == 2.5e12
    )
    assert (
        parse_count("1.1K", "x") == 1100
        and parse_count("0.5K", "x") == 500
        and parse_count(" 300B ", "x") == 3e11
    )
    assert parse_count("9000000000000000000", "x") == 9e18 and parse_count(70e9, "x") == 70e9
    for bad in ("", "-1T", "1X", "0", 1.5, 0.25, float("nan"), float("inf"), 1e300, True):
        with pytest.raises(UserInputError, match=r"^x: "):
            parse_count(bad, "x")


def test_measured_mfu_from_benchmark_results_replaces_the_assumed_one(tmp_path: Path) -> None:
    comparison = compare_training_cost("shakespeare-char", "1B", ["cpu", "h100"], from_benchmarks=RESULTS)
    cpu, h100 = comparison.rows
    # the 2-rank cells are the largest world size measured; the better of ddp (0.504) and fsdp (0.337)
    assert cpu.mfu == pytest.approx(0.5043525586161877) and "ddp ×2" in cpu.mfu_source
    assert (
        cpu.fits and cpu.train_hours is not None and cpu.on_demand_usd is None
    )  # no CPU price in the catalog
    assert h100.mfu is None and h100.train_hours is None and "no benchmark result" in h100.note
    assert cpu.peak_source.startswith("measured: best fp32 1024² matmul")  # the forecast's CPU peak, kept
    assert cpu.step_time_s is not None and cpu.mfu_source in (cpu.step_time_source or "")
    # another model's cells are not this one's MFU, and an MFU over 1 is a bug, not a measurement
    with pytest.raises(UserInputError, match=r"holds no result of gpt2-124m \(it has shakespeare-char\)"):
        compare_training_cost("gpt2-124m", "1B", ["cpu"], from_benchmarks=RESULTS)
    bad = tmp_path / "bad" / "cell"
    bad.mkdir(parents=True)
    cell = json.loads(next(RESULTS.glob("cells/*/result.json")).read_text())
    cell["metrics"]["mfu"] = 1.77
    (bad / "result.json").write_text(json.dumps(cell))
    with pytest.raises(UserInputError, match=r"reports an MFU of 1.77, outside \(0, 1\]"):
        compare_training_cost("shakespeare-char", "1B", ["cpu"], from_benchmarks=tmp_path / "bad")


def test_cost_analyzer_api_reports_and_plot(tmp_path: Path) -> None:
    analyzer = CostAnalyzer(usd_per_kwh=0.10)
    result = analyzer.compare_training_cost(
        model_size="70B", dataset_tokens="1T", platforms=["gaudi3", "h100", "a100"], include_energy=True
    )
    assert [r.platform for r in result.rows] == ["gaudi3", "h100", "a100"]
    h100 = result.rows[1]
    assert h100.energy_usd == pytest.approx(h100.energy_kwh * 0.10)
    without = analyzer.compare_training_cost(model_size="70B", dataset_tokens="1T", include_energy=False)
    assert all(r.energy_kwh is None and r.energy_usd is None for r in without.rows)

    figure = result.plot_tco_breakdown(tmp_path / "tco.png")
    assert len(figure.axes) == 2 and (tmp_path / "tco.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pdf = result.generate_report(tmp_path / "cost_analysis.pdf")
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 10_000
    html = result.generate_report(tmp_path / "cost_analysis.html").read_text()
    assert "data:image/png;base64," in html and 'src="http' not in html and "<link" not in html
    assert "<td>gaudi3</td>" in html and "unknown" in html and "Uptime Institute" in html
    md = result.generate_report(tmp_path / "cost_analysis.md").read_text()
    assert "| h100 |" in md and "![cost per platform" in md and (tmp_path / "cost_analysis.png").exists()
    assert "6·N" in md and "skypilot" in md.lower()  # assumptions and sources travel with the numbers
    with pytest.raises(UserInputError, match=r"report format must be one of \.md, \.html, \.pdf"):
        result.generate_report(tmp_path / "cost.docx")


def test_the_python_call_the_docs_give_as_the_same_makes_the_clis_table(tmp_path: Path) -> None:
    """docs/how-to/plan-cost.md: `CostAnalyzer().compare_training_cost(...)` is "the same from Python" as
    `gaudi3 cost compare` with its defaults: the measured MFU per accelerator, not one assumed for all."""
    cli = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "cost", "compare", "--model", "70B", "--tokens",
                          "1T", "--platforms", "gaudi3,h100,a100", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    rows = json.loads((tmp_path / "cost.json").read_text())["rows"]
    result = CostAnalyzer().compare_training_cost(
        model_size="70B", dataset_tokens="1T", platforms=["gaudi3", "h100", "a100"], include_energy=True
    )
    assert json.loads(json.dumps(result.to_dict()))["rows"] == rows
    assert result.rows[1].mfu == pytest.approx(0.5283) and result.rows[1].mfu_source.startswith("measured")


def test_cli_writes_every_format(tmp_path: Path, gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, out, _ = gaudi3_cli("cost", "compare", "--model", "llama3-70b", "--tokens", "1T", "--platforms",
                              "gaudi3,h100,a100", "--out", str(tmp_path))  # fmt: skip
    assert code == 0
    assert {p.name for p in tmp_path.iterdir()} == {
        "cost.json",
        "cost.md",
        "cost.png",
        "cost.html",
        "cost.pdf",
    }
    data = json.loads((tmp_path / "cost.json").read_text())
    assert [r["platform"] for r in data["rows"]] == ["gaudi3", "h100", "a100"]
    assert data["rows"][0]["on_demand_usd"] is None and data["assumptions"]["pue"] == DEFAULT_PUE
    assert "fit and time" in out and "cost (USD)" in out


def test_catalog_command_lists_sources(gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, out, _ = gaudi3_cli("cost", "catalog")
    assert code == 0 and "p4d.24xlarge" in out and "21.957642" in out and "Hot Chips" in out


def test_the_catalog_asks_for_a_gaudi_price_only_while_none_is_loaded(tmp_path: Path) -> None:
    """The footer asking for a Gaudi instance price names only the Gaudi generations no loaded instance prices."""
    catalog = tmp_path / "ibm.yaml"
    catalog.write_text(
        "sources:\n  quote: our own IBM quote (test fixture)\ninstances:\n"
        "  - {provider: ibm, type: gx3d-160x1792x8gaudi3, accelerator: gaudi3, accelerators_per_node: 8,\n"
        "     region: us-south, on_demand_usd_per_hour: 60, spot_usd_per_hour_range: null,\n"
        "     capacity_block_usd_per_hour: null, prices_date: 2026-11, sources: [quote]}\n"
    )
    shown = {}
    for name, extra in (("shipped", []), ("mine", ["--catalog", str(catalog)])):
        run = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "cost", "catalog", *extra],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})  # fmt: skip
        assert run.returncode == 0, run.stderr
        shown[name] = [line for line in run.stdout.splitlines() if "no sourced instance price" in line]
    assert shown["shipped"] == ["Gaudi 2 / Gaudi 3: no sourced instance price; add one with --catalog FILE."]
    assert shown["mine"] == ["Gaudi 2: no sourced instance price; add one with --catalog FILE."]


def test_assumptions_are_stated() -> None:
    lines = Assumptions(pue=1.2, usd_per_kwh=0.05).lines()
    assert any("PUE 1.2" in line and "$0.05/kWh" in line for line in lines)


def test_gaudi_fit_uses_a_strategy_the_trainer_runs_there() -> None:
    # FSDP2 with ZeRO-3 sharding, built on Gaudi over HCCL; DeepSpeed ZeRO-3 is refused on Gaudi, so never assumed.
    assert Assumptions().strategy == "fsdp"
    assert any(
        "fsdp (FSDP2" in line and "DeepSpeed is not proposed for Gaudi" in line
        for line in Assumptions().lines()
    )
    zero3 = Assumptions(strategy="deepspeed_zero3")
    with pytest.raises(
        UserInputError,
        match=r"^strategy deepspeed_zero3 is not one the trainer runs on gaudi3; allowed: single, ddp, fsdp, fsdp_grad_op$",
    ):
        compare_training_cost("llama3-8b", "1B", ["gaudi3"], assumptions=zero3)
    row = compare_training_cost("llama3-8b", "1B", ["h100"], assumptions=zero3).rows[0]
    assert row.accelerators is not None  # DeepSpeed remains a what-if on CUDA, where the trainer runs it


def test_without_mfu_each_accelerator_gets_ours_measured_or_a_labelled_assumption() -> None:
    gaudi3, h100, h200, a100 = compare_training_cost(
        "llama3-70b", "1T", ["gaudi3", "h100", "h200", "a100"]
    ).rows
    assert h100.mfu == pytest.approx(0.5283) and h100.mfu_source.startswith("measured: Llama 3.2 1B")
    assert "on one H100" in h100.mfu_source and "gpu_cuda_h100_fp8.json" in h100.mfu_source
    assert h200.mfu == pytest.approx(0.5588) and "gpu_shapes_cuda_h200.json" in h200.mfu_source
    # an accelerator no run of ours measured: the H200's, labelled an assumption
    assert a100.mfu == pytest.approx(0.5588) and a100.mfu_source.startswith(
        "assumption: no run of ours measured"
    )
    assert gaudi3.mfu == 0.40 and gaudi3.mfu_source.startswith("assumption: an unsourced fallback")
    assert "not yet validated on Gaudi hardware" in gaudi3.mfu_source


def test_llama3_405b_fits_h100_only_with_a_tensor_or_pipeline_layout() -> None:
    """Plain FSDP fits 405B on no H100 count (micro-batch 1's checkpointed activations alone fill the device); the
    comparison then takes the leanest layout with tensor parallel inside a node × pipeline parallel, and says so."""
    row = compare_training_cost("llama3-405b", "1T", ["h100"], mfu=0.4).rows[0]
    assert row.fits and row.min_accelerators is not None and row.min_accelerators % 8 == 0
    assert "layout tensor parallel 8" in row.note and "plain fsdp fits on no device count" in row.note
    assert row.memory_per_device_gib is not None and row.memory_per_device_gib * 2**30 <= 0.95 * 80e9
