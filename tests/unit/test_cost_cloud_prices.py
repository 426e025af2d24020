"""Azure and GCP price providers against real HTTP servers on 127.0.0.1 that answer in the APIs' own shapes (Azure
Retail Prices: Items + NextPageLink; GCP Cloud Billing Catalog: skus + nextPageToken), set page by page by the test;
the `cost.*` checks that use them, the cache on top of them, and `gaudi3 cost quote` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.metering.azure_prices import AzureRetailPrices
from gaudi3_scale.metering.gcp_prices import GcpCatalogPrices, parse_parts
from gaudi3_scale.metering.live import check_cost_config
from gaudi3_scale.metering.spot import CachedSpotPrices, SpotPriceError, fetch_price, spot_provider
from gaudi3_scale.train.config import build_run_config

SIZE, REGION = "Standard_ND96isr_H100_v5", "eastus"
Answer = tuple[int, Any]  # (HTTP status, JSON body, or bytes sent as they are)


class _Api(ThreadingHTTPServer):
    """Answers GETs with `answer(path_and_query, headers)`; records every request; can hold an answer back."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer: Callable[[str, dict[str, str]], Answer] = lambda path, headers: (404, {})
        self.requests: list[tuple[str, dict[str, list[str]], dict[str, str]]] = []  # (path, query, headers)
        self.hold = threading.Event()  # set: answer at once; clear: wait for it (at most 5 s)
        self.hold.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that gave up waiting is expected
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Api

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.requests.append((parts.path, parse_qs(parts.query), headers))
        self.server.hold.wait(5.0)
        status, body = self.server.answer(self.path, headers)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def api() -> Iterator[_Api]:
    server = _Api()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield server
    server.hold.set()
    server.shutdown()
    server.server_close()


# --- Azure ---------------------------------------------------------------------------------------------------------


def _meter(sku: str, price: float, start: str = "2026-01-01T00:00:00Z", **fields: Any) -> dict[str, Any]:
    """One Retail Prices item as the API writes it."""
    item = {"currencyCode": "USD", "tierMinimumUnits": 0.0, "retailPrice": price, "unitPrice": price,
            "armRegionName": REGION, "location": "US East", "effectiveStartDate": start,
            "meterId": f"meter-{sku}", "meterName": sku, "productName": "Virtual Machines NDsr H100 v5 Series",
            "skuName": sku, "serviceName": "Virtual Machines", "serviceFamily": "Compute",
            "unitOfMeasure": "1 Hour", "type": "Consumption", "isPrimaryMeterRegion": True, "armSkuName": SIZE}  # fmt: skip
    item.update(fields)
    return item


def _azure_pages(api: _Api, pages: list[list[dict[str, Any]]], next_link: str | None = None) -> None:
    """Page i answers `?...&$skip=i*100`; each links the next on this server (or `next_link` from the first)."""

    def answer(path: str, headers: dict[str, str]) -> Answer:
        index = int(parse_qs(urlsplit(path).query).get("$skip", ["0"])[0]) // 100
        link = next_link or f"{api.url}/api/retail/prices?$skip={(index + 1) * 100}"
        more = index + 1 < len(pages)
        return 200, {"BillingCurrency": "USD", "CustomerEntityId": "Default", "CustomerEntityType": "Retail",
                     "Items": pages[index], "NextPageLink": link if more else None, "Count": len(pages[index])}  # fmt: skip

    api.answer = answer


def _azure(api: _Api, **kwargs: Any) -> AzureRetailPrices:
    return AzureRetailPrices(endpoint_url=f"{api.url}/api/retail/prices", **kwargs)


def test_azure_spot_and_pay_as_you_go_across_pages(api: _Api) -> None:
    _azure_pages(api, [
        [_meter("ND96isr H100 v5", 105.0, "2025-01-01T00:00:00Z"),  # pay-as-you-go: an older, higher price
         _meter("ND96isr H100 v5", 98.32),  # … its current one
         _meter("ND96isr H100 v5", 120.0, productName="Virtual Machines NDsr H100 v5 Series Windows"),
         _meter("ND96isr H100 v5 Low Priority", 9.0),  # Azure Batch: never ours
         _meter("ND96isr H100 v5", 80.0, type="DevTestConsumption"),
         _meter("ND96isr H100 v5 Spot", 20.0)],
        [_meter("ND96isr H100 v5 Spot", 25.5, meterId="another-spot-meter"),  # two spot meters: the higher
         _meter("ND96isr H100 v5 Spot", 40.0, armRegionName="westus"),  # another region (the API filters; we too)
         _meter("ND96isr H100 v5 Spot", 41.0, unitOfMeasure="1/Month")],
    ])  # fmt: skip
    provider = _azure(api)
    spot = provider.fetch(SIZE, REGION)
    assert (spot.usd_per_hour, spot.pricing, spot.priced_as) == (25.5, "spot", "ND96isr H100 v5 Spot")
    assert (spot.provider, spot.instance_type, spot.region, spot.availability_zone) == (
        "azure",
        SIZE,
        REGION,
        None,
    )
    on_demand = fetch_price(provider, SIZE, REGION, "on_demand")
    assert (on_demand.usd_per_hour, on_demand.pricing) == (98.32, "on_demand")
    assert len(api.requests) == 4 and api.requests[1][1]["$skip"] == ["100"]
    path, query, _ = api.requests[0]
    assert path == "/api/retail/prices"
    assert query["$filter"] == [
        f"serviceName eq 'Virtual Machines' and armRegionName eq '{REGION}' and armSkuName eq '{SIZE}' "
        "and priceType eq 'Consumption'"
    ]


def test_azure_answers_without_a_price_are_one_line_errors(api: _Api) -> None:
    provider = _azure(api)
    cases: list[tuple[Answer, str]] = [
        ((500, {"error": {"code": "Internal", "message": "try later"}}), "HTTP 500 Internal Server Error: try later"),
        ((200, b"<html>maintenance</html>"), "the answer is not JSON: b'<html>maintenance</html>'"),
        ((200, [1, 2]), "expected a JSON object, got list"),
        ((200, {"items": []}), "unexpected answer: no 'Items' list"),
        ((200, {"Items": [], "NextPageLink": None}), "no Linux spot hourly price among 0 item(s)"),
        ((200, {"Items": [_meter("ND96isr H100 v5 Spot", -1.0)]}), "retailPrice must be a positive number"),
        ((200, {"Items": [_meter("ND96isr H100 v5 Spot", 1.0, currencyCode="EUR")]}), "price in 'EUR'"),
        ((200, {"Items": [_meter("ND96isr H100 v5 Spot", 1.0, effectiveStartDate="soon")]}),
         "unreadable effectiveStartDate"),
    ]  # fmt: skip
    for answer, message in cases:
        api.answer = lambda path, headers, a=answer: a  # type: ignore[misc]
        with pytest.raises(SpotPriceError) as caught:
            provider.fetch(SIZE, REGION)
        text = str(caught.value)
        assert text.startswith(f"azure spot price for {SIZE} in {REGION}: ") and message in text, text
        assert "\n" not in text
    _azure_pages(api, [[], []], next_link="https://elsewhere.example/api/retail/prices?$skip=100")
    with pytest.raises(SpotPriceError, match=r"NextPageLink 'https://elsewhere\.example/.*' leaves"):
        provider.fetch(SIZE, REGION)
    with pytest.raises(UserInputError, match="azure VM size must be an ARM name"):
        provider.fetch("Standard_ND96' or '1' eq '1", REGION)  # never reaches the filter
    with pytest.raises(UserInputError, match="per region, not per zone"):
        AzureRetailPrices(availability_zone="1")


def test_slow_api_fails_within_the_timeout_and_the_cache_keeps_the_last_price(api: _Api) -> None:
    _azure_pages(api, [[_meter("ND96isr H100 v5 Spot", 20.0)]])
    warnings: list[str] = []
    cache = CachedSpotPrices(_azure(api, timeout_s=0.3), ttl_s=3600.0, warn=warnings.append)
    first = cache.refresh_now(SIZE, REGION, timeout_s=5.0)
    assert first is not None and first.usd_per_hour == 20.0 and not first.stale
    api.hold.clear()  # the next answer waits until the test is done
    start = time.monotonic()
    quote = cache.refresh_now(SIZE, REGION, timeout_s=5.0)
    assert time.monotonic() - start < 2.0
    api.hold.set()
    assert quote is not None and quote.stale and quote.usd_per_hour == 20.0
    assert len(warnings) == 1 and "timed out" in warnings[0] and "(training continues)" in warnings[0]
    cache.close()


# --- GCP -----------------------------------------------------------------------------------------------------------

KEY = "test-key-not-secret"
GPU, CORE = "Example H100 80GB GPU", "Example Instance Core"


def _sku(description: str, usage: str, usd: tuple[int, int], regions: tuple[str, ...] = ("us-central1",),
         unit: str = "h", effective: str = "2026-11-26T08:00:00Z") -> dict[str, Any]:  # fmt: skip
    """One Catalog SKU as the API writes it: unitPrice {units (a string: int64 in JSON), nanos}."""
    units, nanos = usd
    return {
        "name": f"services/6F81-5844-456A/skus/{abs(hash((description, usage, regions))) % 10**8}",
        "description": f"{description} running in Americas",
        "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": "Compute",
                     "resourceGroup": "GPU", "usageType": usage},
        "serviceRegions": list(regions),
        "pricingInfo": [{"effectiveTime": effective, "summary": "",
                         "pricingExpression": {"usageUnit": unit, "displayQuantity": 1, "baseUnit": "s",
                                               "baseUnitConversionFactor": 3600,
                                               "tieredRates": [{"startUsageAmount": 0, "unitPrice": {
                                                   "currencyCode": "USD", "units": str(units), "nanos": nanos}}]},
                         "currencyConversionRate": 1}],
        "serviceProviderName": "Google",
    }  # fmt: skip


def _gcp_pages(api: _Api, pages: list[list[dict[str, Any]]]) -> None:
    def answer(path: str, headers: dict[str, str]) -> Answer:
        if headers.get("x-goog-api-key") != KEY:
            return 400, {"error": {"code": 400, "message": "API key not valid. Please pass a valid API key.",
                                   "status": "INVALID_ARGUMENT"}}  # fmt: skip
        index = int(parse_qs(urlsplit(path).query).get("pageToken", ["0"])[0])
        token = str(index + 1) if index + 1 < len(pages) else ""
        return 200, {"skus": pages[index], "nextPageToken": token}

    api.answer = answer


@pytest.fixture
def gcp_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_CLOUD_API_KEY", KEY)


def _gcp(api: _Api) -> GcpCatalogPrices:
    return GcpCatalogPrices(endpoint_url=f"{api.url}/v1/services/6F81-5844-456A/skus")


def test_gcp_sums_sku_parts_across_pages(api: _Api, gcp_key: None) -> None:
    newer = _sku(CORE, "OnDemand", (0, 31_000_000))
    newer["pricingInfo"].insert(
        0, _sku(CORE, "OnDemand", (9, 0), effective="2026-10-01T00:00:00Z")["pricingInfo"][0]
    )
    _gcp_pages(api, [
        [_sku(GPU, "OnDemand", (11, 60_000_000)),
         _sku(GPU, "Preemptible", (2, 250_000_000)),
         _sku(GPU, "Commit1Yr", (7, 0)),
         _sku(GPU, "OnDemand", (50, 0), regions=("europe-west4",))],  # not offered in the region asked for
        [newer,  # a pricing timeline: the newest entry counts
         _sku(f"Spot Preemptible {CORE}", "Preemptible", (0, 10_000_000))],
    ])  # fmt: skip
    provider, machine = _gcp(api), f"8*{GPU} + 2*{CORE.lower()}"
    on_demand = provider.fetch_on_demand(machine, "us-central1")
    assert on_demand.usd_per_hour == pytest.approx(8 * 11.06 + 2 * 0.031)
    assert on_demand.priced_as == f"8 × {GPU} running in Americas + 2 × {CORE} running in Americas"
    spot = provider.fetch(machine, "us-central1")
    assert (spot.pricing, spot.usd_per_hour) == ("spot", pytest.approx(8 * 2.25 + 2 * 0.01))
    assert len(api.requests) == 4
    (_, first, headers), (_, second, _) = api.requests[:2]
    assert first == {"currencyCode": ["USD"], "pageSize": ["5000"]} and second["pageToken"] == ["1"]
    assert headers["x-goog-api-key"] == KEY and all("key" not in q for _, q, _ in api.requests)
    assert parse_parts("1.5*A+2 * B") == [(1.5, "A"), (2.0, "B")]


def test_gcp_highest_matching_sku_and_errors(api: _Api, gcp_key: None) -> None:
    _gcp_pages(api, [[_sku(GPU, "OnDemand", (11, 0)), _sku(f"{GPU} Plus", "OnDemand", (12, 0)),
                      _sku("Example Storage", "OnDemand", (1, 0), unit="GiBy.mo")]])  # fmt: skip
    provider = _gcp(api)
    quote = provider.fetch_on_demand(f"1*{GPU}", "us-central1")
    assert (quote.usd_per_hour, quote.priced_as) == (12.0, f"1 × {GPU} Plus running in Americas")
    for machine, message in [
        (
            "1*Example TPU",
            "no OnDemand SKU whose description contains 'Example TPU' is offered in us-central1",
        ),
        ("1*Example Storage", "priced per 'GiBy.mo', not per hour"),
    ]:
        with pytest.raises(SpotPriceError) as caught:
            provider.fetch_on_demand(machine, "us-central1")
        assert str(caught.value) == f"gcp on-demand price for {machine} in us-central1: " + (
            message if "TPU" in machine else f"SKU 'Example Storage running in Americas': {message}"
        )
    with pytest.raises(SpotPriceError, match="no Preemptible SKU"):
        provider.fetch(f"8*{GPU}", "us-central1")
    for machine in ("a3-highgpu-8g", "0*x", "eight*x", "8*", "8*x+"):
        with pytest.raises(UserInputError, match=r"COUNT\*SKU description"):
            provider.fetch(machine, "us-central1")
    api.answer = lambda path, headers: (200, {"skus": [{"description": "no category"}]})
    with pytest.raises(SpotPriceError, match="unreadable SKU"):
        provider.fetch(f"8*{GPU}", "us-central1")


def test_gcp_key_comes_from_the_environment_only(api: _Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOOGLE_CLOUD_API_KEY", raising=False)
    with pytest.raises(UserInputError, match="API key in the environment variable GOOGLE_CLOUD_API_KEY"):
        spot_provider("gcp")
    monkeypatch.setenv("GOOGLE_CLOUD_API_KEY", "wrong-key")
    _gcp_pages(api, [[]])
    with pytest.raises(SpotPriceError, match=r"HTTP 400 Bad Request: API key not valid\.") as caught:
        _gcp(api).fetch(f"8*{GPU}", "us-central1")
    assert "wrong-key" not in str(caught.value)


# --- the cost section and the CLI ----------------------------------------------------------------------------------


def test_cost_config_checks_the_cloud_providers_before_a_run(gcp_key: None) -> None:
    def check(*overrides: str) -> None:
        check_cost_config(build_run_config(None, parse_overrides(["--cost.pricing", "spot",
                                                                  "--cost.price_usd_per_hour", "50", *overrides])).cost)  # fmt: skip

    check("--cost.instance", f"gcp/8*{GPU}/us-central1", "--cost.spot_provider", "gcp")
    check("--cost.instance", f"azure/{SIZE}/{REGION}", "--cost.spot_provider", "azure")
    with pytest.raises(ConfigError, match=r"^cost\.instance: gcp prices SKUs, not machine types"):
        check("--cost.instance", "gcp/a3-highgpu-8g/us-central1", "--cost.spot_provider", "gcp")
    with pytest.raises(
        ConfigError, match=r"^cost\.spot_availability_zone: azure prices a VM size per region"
    ):
        check("--cost.instance", f"azure/{SIZE}/{REGION}", "--cost.spot_provider", "azure",
              "--cost.spot_availability_zone", "eastus-az1")  # fmt: skip


def test_cost_quote_cli(api: _Api, gaudi3_cli: Callable[..., tuple[int, str, str]],
                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    _azure_pages(api, [[_meter("ND96isr H100 v5", 98.32), _meter("ND96isr H100 v5 Spot", 21.5)]])
    endpoint = f"{api.url}/api/retail/prices"
    done = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "cost", "quote", "--provider", "azure", "--type", SIZE,
         "--region", REGION, "--pricing", "on_demand", "--endpoint-url", endpoint],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"azure on_demand {SIZE} in {REGION}: $98.3200/h per node (ND96isr H100 v5)\n"
    monkeypatch.delenv("GOOGLE_CLOUD_API_KEY", raising=False)
    code, out, err = gaudi3_cli(
        "cost", "quote", "--provider", "gcp", "--type", f"8*{GPU}", "--region", "us-central1"
    )
    assert (code, out) == (2, "") and err.count("\n") == 1 and "GOOGLE_CLOUD_API_KEY" in err
    api.answer = lambda path, headers: (503, {})
    code, out, err = gaudi3_cli("cost", "quote", "--provider", "azure", "--type", SIZE, "--region", REGION,
                                "--endpoint-url", endpoint)  # fmt: skip
    assert (code, out) == (
        1,
        "",
    ) and err == f"gaudi3: error: azure spot price for {SIZE} in {REGION}: HTTP 503 Service Unavailable\n"
