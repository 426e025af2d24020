"""`gaudi3 cost compare|catalog|quote`: what training a model costs per platform, the sourced catalog behind it, and
a live price from a cloud's price API."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gaudi3_scale.cli.options import Count, Number, Seconds
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import check_output_dir
from gaudi3_scale.config.numbers import MAX_WORLD_SIZE

__all__ = ["cost"]


@click.group()
def cost() -> None:
    """Cost and capacity planning from the sourced accelerator and instance catalog."""


@cost.command(name="compare")
@click.option("--model", required=True, help="model preset (llama3-70b) or a size naming one (70B)")
@click.option("--tokens", required=True, help="training tokens: 1T, 300B, 2.5e12")
@click.option(
    "--platforms", default="gaudi3,h100,a100", show_default=True,
    help="comma-separated accelerators (catalog names or aliases: gaudi3, gaudi2, h100, h200, a100, a100-40gb, "
    "mi300x) or cpu (measured on this machine)",
)  # fmt: skip
@click.option(
    "--mfu",
    type=Number(integer=False),
    help="model FLOPs utilization assumed on every platform [default: our measurement of the kind of device where "
    "we have one (an H200's, for CUDA), else 0.40, labelled an assumption]",
)
@click.option(
    "--from-benchmarks", type=click.Path(file_okay=False),
    help="benchmark results directory: use each accelerator's best measured MFU instead of --mfu",
)  # fmt: skip
@click.option(
    "--nodes",
    type=Count(high=MAX_WORLD_SIZE),
    help="nodes to train on (default: the fewest that fit the model)",
)
@click.option("--context-length", type=Count(), help="tokens per sequence (default: the model's)")
@click.option(
    "--catalog", "catalog_file", type=click.Path(dir_okay=False), help="instance catalog override YAML"
)
@click.option(
    "--pue",
    type=Number(integer=False, low=1, high=10),  # facility ÷ IT energy: 1 at the least
    help="power usage effectiveness [default: 1.58, Uptime Institute 2023 average]",
)
@click.option(
    "--power-fraction",
    type=Number(integer=False, above=0, high=2),
    default=1.0,
    show_default=True,
    help="average power ÷ TDP",
)
@click.option(
    "--usd-per-kwh",
    type=Number(integer=False, low=0, high=100),
    help="electricity price for the energy $ column (default: unknown)",
)
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="also write cost.json, cost.md + cost.png, cost.html and cost.pdf here")  # fmt: skip
def compare_cmd(
    model: str,
    tokens: str,
    platforms: str,
    mfu: float | None,
    from_benchmarks: str | None,
    nodes: int | None,
    context_length: int | None,
    catalog_file: str | None,
    pue: float | None,
    power_fraction: float,
    usd_per_kwh: float | None,
    out_dir: str | None,
) -> None:
    """Accelerators needed to fit, training time, $ (on-demand, spot, capacity block), energy, $ per 1M tokens and
    tokens per $, per platform. Unknown prices print as "unknown". Exit 2 on bad input or a model that fits
    nowhere."""
    from gaudi3_scale.cli.config_cmd import wide_console
    from gaudi3_scale.cost.estimate import DEFAULT_PUE, Assumptions, compare_training_cost
    from gaudi3_scale.cost.report import print_table, write_outputs

    if mfu is not None and from_benchmarks is not None:
        raise UserInputError("--mfu and --from-benchmarks are exclusive: give one")
    if out_dir:
        check_output_dir("--out", out_dir)  # before the table, not after it
    names = [p.strip() for p in platforms.split(",") if p.strip()]
    comparison = compare_training_cost(
        model,
        tokens,
        names,
        mfu=None if from_benchmarks else mfu,
        from_benchmarks=Path(from_benchmarks) if from_benchmarks else None,
        nodes=nodes,
        context_length=context_length,
        catalog_file=Path(catalog_file) if catalog_file else None,
        assumptions=Assumptions(
            pue=DEFAULT_PUE if pue is None else pue,
            power_fraction_of_tdp=power_fraction,
            usd_per_kwh=usd_per_kwh,
        ),
    )
    console = wide_console()
    print_table(comparison, console)
    if out_dir:
        written = write_outputs(comparison, Path(out_dir))
        console.print(f"wrote {', '.join(str(p) for p in written)}", highlight=False, soft_wrap=True)


@cost.command(name="catalog")
@click.option(
    "--catalog", "catalog_file", type=click.Path(dir_okay=False), help="instance catalog override YAML"
)
def catalog_cmd(catalog_file: str | None) -> None:
    """The accelerator specs and instance prices the estimates use, each with its source."""
    from rich.table import Table

    from gaudi3_scale.cli.config_cmd import wide_console
    from gaudi3_scale.device.specs import ACCELERATORS
    from gaudi3_scale.metering.catalog import load_instances

    def known(value: float | None, spec: str = ",.2f") -> str:
        return "unknown" if value is None else format(value, spec)

    # a bad --catalog is refused before anything is printed
    instances = load_instances(Path(catalog_file) if catalog_file else None).values()
    console = wide_console()
    specs = Table(title="accelerators (cpu: measured on the machine at run time)", title_justify="left")
    for header in ("name", "aliases", "BF16 TFLOP/s", "FP8 TFLOP/s", "memory GB", "TB/s", "TDP W"):
        specs.add_column(header, no_wrap=True)
    for s in ACCELERATORS.values():
        specs.add_row(s.name, ", ".join(s.aliases), known(s.bf16_dense_tflops, ",.1f"),
                      known(s.fp8_dense_tflops, ",.1f"), f"{s.memory_gb:g}", known(s.memory_bandwidth_tbps, "g"),
                      known(s.tdp_w, "g"))  # fmt: skip
    console.print(specs)
    for s in ACCELERATORS.values():  # sources are sentences: below the table, one per entry
        console.print(f"  {s.name}: {s.source}", highlight=False, soft_wrap=True)
    prices = Table(title="instances (USD per node-hour)", title_justify="left")
    for header in (
        "provider",
        "type",
        "region",
        "accelerators",
        "on-demand",
        "spot",
        "capacity block",
        "date",
    ):
        prices.add_column(header, no_wrap=header != "date")
    for i in instances:
        spot = (
            "unknown" if i.spot_usd_per_hour_range is None else "–".join(map(str, i.spot_usd_per_hour_range))
        )
        prices.add_row(i.provider, i.type, i.region, f"{i.accelerators_per_node} × {i.accelerator}",
                       known(i.on_demand_usd_per_hour, ""), spot, known(i.capacity_block_usd_per_hour, ""),
                       i.prices_date)  # fmt: skip
    console.print(prices)
    for i in instances:
        console.print(f"  {i.type} ({i.region}): {i.source}", highlight=False, soft_wrap=True)
    # The shipped catalog prices no Gaudi instance (no primary source); a --catalog that does needs no such hint.
    priced = {
        i.accelerator
        for i in instances
        if (i.on_demand_usd_per_hour, i.spot_usd_per_hour_range, i.capacity_block_usd_per_hour) != (None,) * 3
    }
    unpriced = [name for key, name in (("gaudi2", "Gaudi 2"), ("gaudi3", "Gaudi 3")) if key not in priced]
    if unpriced:
        console.print(
            f"{' / '.join(unpriced)}: no sourced instance price; add one with --catalog FILE.",
            highlight=False,
        )


@cost.command(name="quote")
@click.option(
    "--provider", "provider_name", required=True, help="price API: aws, azure or gcp (docs/cost.md)"
)
@click.option(
    "--type", "instance_type", required=True,
    help="an EC2 instance type, an Azure VM size (Standard_ND96isr_H100_v5), or for gcp COUNT*SKU description[+…]",
)  # fmt: skip
@click.option("--region", required=True, help="us-east-1 (aws), eastus (azure), us-central1 (gcp)")
@click.option("--pricing", type=click.Choice(["spot", "on_demand"]), default="spot", show_default=True)
@click.option("--endpoint-url", help="the price API's URL [default: the provider's public endpoint]")
@click.option("--timeout-s", type=Seconds(), default=10.0, show_default=True,
              help="seconds per connection and per read")  # fmt: skip
def quote_cmd(
    provider_name: str,
    instance_type: str,
    region: str,
    pricing: str,
    endpoint_url: str | None,
    timeout_s: float,
) -> None:
    """The current price of one instance (the whole node) in USD/h from the provider's price API. Exit 2 on bad
    input (an unknown provider, a missing gcp key), 1 when the API gives no price."""
    from gaudi3_scale.config.errors import print_error
    from gaudi3_scale.config.urls import check_http_url
    from gaudi3_scale.metering.spot import SpotPriceError, fetch_price, spot_provider

    check_http_url("--endpoint-url", endpoint_url)
    for flag, value in (("--type", instance_type), ("--region", region)):
        if not value.strip():
            raise UserInputError(
                f"{flag}: empty; pass a name such as {'p5.48xlarge' if flag == '--type' else 'us-east-1'}"
            )
    provider = spot_provider(provider_name, endpoint_url=endpoint_url, timeout_s=timeout_s)
    check = getattr(provider, "check_instance", None)
    if check is not None:
        check(instance_type, region)
    try:
        quote = fetch_price(provider, instance_type, region, "spot" if pricing == "spot" else "on_demand")
    except SpotPriceError as exc:
        print_error(str(exc))
        sys.exit(1)
    what = f" ({quote.priced_as})" if quote.priced_as else ""
    zone = f", zone {quote.availability_zone}" if quote.availability_zone else ""
    click.echo(
        f"{quote.provider} {pricing} {quote.instance_type} in {quote.region}{zone}: "
        f"${quote.usd_per_hour:,.4f}/h per node{what}"
    )
