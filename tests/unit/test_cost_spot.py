"""Spot prices: boto3 against real local servers (moto's EC2, and a tiny EC2 stand-in whose prices the test sets),
the background cache with a test-controlled provider and clock, and the pause/continue/scale-up policy."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.metering import spot
from gaudi3_scale.metering.spot import (
    AwsSpotPrices,
    CachedSpotPrices,
    SpotPolicy,
    SpotPriceError,
    SpotQuote,
    register_spot_provider,
    spot_provider,
)

TYPE, REGION = "p5.48xlarge", "us-east-1"


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy credentials, and nothing from this machine's AWS config (no profile, endpoint or metadata service)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_EC2"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    pytest.importorskip("boto3", reason="needs the `spot` extra")
    server_module = pytest.importorskip("moto.server", reason="needs moto (test extra)")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def _raw_moto_prices(url: str, zone: str | None = None) -> dict[str, float]:
    """What moto serves, read with a plain boto3 call: zone -> price."""
    import boto3

    client = boto3.client("ec2", region_name=REGION, endpoint_url=url)
    records = client.describe_spot_price_history(InstanceTypes=[TYPE])["SpotPriceHistory"]
    prices = {r["AvailabilityZone"]: float(r["SpotPrice"]) for r in records}
    assert len(prices) >= 2, f"moto should answer for several zones, got {records}"
    return prices


def test_aws_quote_is_the_highest_zone_price_moto_serves(aws_env: None, moto_url: str) -> None:
    served = _raw_moto_prices(moto_url)
    before = time.time()
    quote = AwsSpotPrices(endpoint_url=moto_url).fetch(TYPE, REGION)
    assert quote.usd_per_hour == max(served.values())
    assert quote.availability_zone in served
    assert served[quote.availability_zone] == quote.usd_per_hour
    assert (quote.provider, quote.instance_type, quote.region, quote.stale) == ("aws", TYPE, REGION, False)
    assert before <= quote.fetched_at_unix <= time.time()


def test_aws_quote_for_one_zone(aws_env: None, moto_url: str) -> None:
    served = _raw_moto_prices(moto_url)
    zone = sorted(served)[1]
    quote = AwsSpotPrices(endpoint_url=moto_url, availability_zone=zone).fetch(TYPE, REGION)
    assert (quote.availability_zone, quote.usd_per_hour) == (zone, served[zone])
    with pytest.raises(SpotPriceError, match="zone us-east-1x"):
        AwsSpotPrices(endpoint_url=moto_url, availability_zone="us-east-1x").fetch(TYPE, REGION)


def test_aws_unknown_instance_type_is_an_error(aws_env: None, moto_url: str) -> None:
    with pytest.raises(SpotPriceError, match=r"no\.such in us-east-1: no 'Linux/UNIX' prices"):
        AwsSpotPrices(endpoint_url=moto_url).fetch("no.such", REGION)


def test_policy_on_the_moto_served_quote(aws_env: None, moto_url: str) -> None:
    quote = AwsSpotPrices(endpoint_url=moto_url).fetch(TYPE, REGION)
    served = max(_raw_moto_prices(moto_url).values())  # moto's placeholder, 0.00001 in moto 5.2
    assert SpotPolicy(scale_up_below_usd_per_hour=1.0).decide(quote).action == "scale_up"
    assert SpotPolicy(pause_above_usd_per_hour=0.000001).decide(quote).action == "pause"
    decision = SpotPolicy().decide(quote)
    assert (decision.action, decision.usd_per_hour) == ("continue", served)
    assert decision.as_metrics() == {"spot_price_usd_per_hour": served, "spot_decision": 0.0}


# --- a stand-in EC2 endpoint: real boto3 parsing, prices and pages set by the test -------------------------------

_ITEM = """<item><instanceType>{type}</instanceType><productDescription>Linux/UNIX</productDescription>
<spotPrice>{price}</spotPrice><timestamp>{time}</timestamp><availabilityZone>{zone}</availabilityZone></item>"""


class _Ec2(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Ec2Handler)
        self.pages: list[list[tuple[str, str, str]]] = []  # per page: (zone, price, ISO time)
        self.delay_s = 0.0
        self.requests: list[dict[str, list[str]]] = []  # the form of each request

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out (the slow-endpoint test) has gone when the delayed answer is written; the broken
        # pipe is expected, and its traceback would land in whatever test runs next in this process.
        if not isinstance(sys.exc_info()[1], BrokenPipeError | ConnectionResetError):
            super().handle_error(request, client_address)


class _Ec2Handler(BaseHTTPRequestHandler):
    server: _Ec2

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        self.server.requests.append(form)
        time.sleep(self.server.delay_s)
        index = int(form.get("NextToken", ["0"])[0])
        items = "".join(
            _ITEM.format(type=TYPE, zone=z, price=p, time=t) for z, p, t in self.server.pages[index]
        )
        token = f"<nextToken>{index + 1}</nextToken>" if index + 1 < len(self.server.pages) else ""
        body = (
            '<DescribeSpotPriceHistoryResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
            f"<requestId>r-{index}</requestId><spotPriceHistorySet>{items}</spotPriceHistorySet>{token}"
            "</DescribeSpotPriceHistoryResponse>"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def ec2() -> Iterator[_Ec2]:
    pytest.importorskip("boto3", reason="needs the `spot` extra")
    server = _Ec2()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_aws_takes_the_newest_price_per_zone_then_the_highest_across_pages(aws_env: None, ec2: _Ec2) -> None:
    ec2.pages = [
        [("us-east-1a", "30.00", "2026-11-23T08:00:00Z"), ("us-east-1a", "11.00", "2026-11-23T10:00:00Z")],
        [("us-east-1b", "12.50", "2026-11-23T09:00:00Z"), ("us-east-1c", "9.00", "2026-11-23T09:30:00Z")],
    ]
    url = f"http://127.0.0.1:{ec2.server_address[1]}"
    quote = AwsSpotPrices(endpoint_url=url).fetch(TYPE, REGION)
    # 30.00 is 1a's old price; 1a is now 11.00, so the highest current price is 1b's, from the second page.
    assert (quote.availability_zone, quote.usd_per_hour) == ("us-east-1b", 12.5)
    assert len(ec2.requests) == 2 and ec2.requests[1]["NextToken"] == ["1"]
    first = ec2.requests[0]
    assert first["Action"] == ["DescribeSpotPriceHistory"]
    assert first["InstanceType.1"] == [TYPE] and first["ProductDescription.1"] == ["Linux/UNIX"]
    assert "StartTime" in first and "AvailabilityZone" not in first

    zone_quote = AwsSpotPrices(endpoint_url=url, availability_zone="us-east-1a").fetch(TYPE, REGION)
    assert (zone_quote.availability_zone, zone_quote.usd_per_hour) == ("us-east-1a", 11.0)
    assert ec2.requests[2]["AvailabilityZone"] == ["us-east-1a"]


def test_aws_slow_endpoint_fails_within_the_timeout(aws_env: None, ec2: _Ec2) -> None:
    # The server answers after 30 s; the client gives up after its 0.5 s read timeout. The bound leaves room for
    # building the boto3 client (its EC2 model: 2.5 s in all once, on 2 cores shared with a training test).
    ec2.pages, ec2.delay_s = [[("us-east-1a", "1.0", "2026-11-23T08:00:00Z")]], 30.0
    provider = AwsSpotPrices(endpoint_url=f"http://127.0.0.1:{ec2.server_address[1]}", timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(SpotPriceError, match="ReadTimeoutError") as caught:
        provider.fetch(TYPE, REGION)
    assert time.monotonic() - start < 10.0
    assert len(ec2.requests) == 1, "one attempt: retrying is the cache's job"
    assert "\n" not in str(caught.value)


# --- failures never reach training ---------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_unreachable_endpoint(aws_env: None) -> None:
    provider = AwsSpotPrices(endpoint_url=f"http://127.0.0.1:{_closed_port()}", timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(SpotPriceError, match=r"^aws spot price for p5\.48xlarge in us-east-1: .*connect"):
        provider.fetch(TYPE, REGION)
    assert time.monotonic() - start < 3.0

    warnings: list[str] = []
    clock = _Clock()
    cache = CachedSpotPrices(provider, ttl_s=60.0, clock=clock, warn=warnings.append)
    assert cache.price(TYPE, REGION) is None
    _wait_for(lambda: len(warnings) == 1)
    clock.now_s += 61  # the next attempt fails the same way: no second warning
    assert cache.price(TYPE, REGION) is None
    assert cache.refresh_now(TYPE, REGION, timeout_s=5.0) is None
    assert len(warnings) == 1 and "training continues" in warnings[0]
    cache.close()


def test_missing_boto3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # `import boto3` now raises ImportError
    with pytest.raises(SpotPriceError, match=r"pip install 'gaudi3-scale\[spot\]'"):
        AwsSpotPrices().fetch(TYPE, REGION)


# --- the cache, with a provider the test controls ------------------------------------------------------------------


class _Provider:
    name = "test"

    def __init__(self, usd_per_hour: float = 10.0, delay_s: float = 0.0) -> None:
        self.usd_per_hour = usd_per_hour
        self.error: str | None = None
        self.delay_s = delay_s
        self.release = threading.Event()  # ends a delay early
        self.fetches = 0  # begun
        self.answered = 0  # returned or raised

    def fetch(self, instance_type: str, region: str) -> SpotQuote:
        self.fetches += 1
        try:
            return self._answer(instance_type, region)
        finally:
            self.answered += 1

    def _answer(self, instance_type: str, region: str) -> SpotQuote:
        self.release.wait(self.delay_s)
        if self.error is not None:
            raise SpotPriceError(self.error)
        return SpotQuote(
            usd_per_hour=self.usd_per_hour,
            instance_type=instance_type,
            region=region,
            availability_zone=None,
            provider=self.name,
            fetched_at_unix=time.time(),
        )


def _price_of(cache: CachedSpotPrices) -> float | None:
    quote = cache.price(TYPE, REGION)
    return None if quote is None else quote.usd_per_hour


def test_cache_refetches_only_after_the_ttl() -> None:
    provider, clock = _Provider(10.0), _Clock()
    cache = CachedSpotPrices(provider, ttl_s=300.0, clock=clock)
    assert cache.price(TYPE, REGION) is None  # nothing yet; a refresh has started
    _wait_for(lambda: _price_of(cache) == 10.0)
    provider.usd_per_hour = 20.0
    clock.now_s += 299
    for _ in range(5):
        assert _price_of(cache) == 10.0
    assert provider.fetches == 1
    clock.now_s += 1
    assert _price_of(cache) == 10.0  # the refresh runs in the background; the old price is returned at once
    _wait_for(lambda: _price_of(cache) == 20.0)
    assert provider.fetches == 2
    assert cache.price("other.type", REGION) is None  # its own key, its own fetch
    _wait_for(lambda: provider.fetches == 3)
    cache.close()


def test_cache_keeps_the_last_price_marked_stale_after_a_failure() -> None:
    provider, clock, warnings = _Provider(10.0), _Clock(), list[str]()
    cache = CachedSpotPrices(provider, ttl_s=60.0, clock=clock, warn=warnings.append)
    assert cache.refresh_now(TYPE, REGION) == cache.price(TYPE, REGION)
    provider.error = "test spot price for p5.48xlarge in us-east-1: the API is down"
    for failures in range(1, 4):  # three failed refreshes, one warning
        clock.now_s += 60
        # price() starts the next refresh once the previous outcome is stored, and always has a quote to give.
        _wait_for(lambda: cache.price(TYPE, REGION) is not None and provider.fetches == 1 + failures)  # noqa: B023
    _wait_for(lambda: cache.price(TYPE, REGION).stale)  # type: ignore[union-attr]
    quote = cache.price(TYPE, REGION)
    assert quote is not None and quote.stale and quote.usd_per_hour == 10.0
    assert provider.fetches == 4
    assert warnings == [f"{provider.error} (training continues)"]
    provider.error, provider.usd_per_hour = None, 12.0
    clock.now_s += 60
    cache.price(TYPE, REGION)
    _wait_for(lambda: _price_of(cache) == 12.0)
    fresh = cache.price(TYPE, REGION)
    assert fresh is not None and not fresh.stale
    cache.close()


def test_slow_provider_never_blocks_and_refreshes_once_at_a_time() -> None:
    provider, clock, warnings = _Provider(10.0, delay_s=3.0), _Clock(), list[str]()
    cache = CachedSpotPrices(provider, ttl_s=60.0, clock=clock, warn=warnings.append)
    try:
        start = time.perf_counter()
        for _ in range(20):
            assert cache.price(TYPE, REGION) is None
            clock.now_s += 100  # long past the TTL, yet one refresh is in flight already
        assert time.perf_counter() - start < 0.2
        start = time.perf_counter()
        assert cache.refresh_now(TYPE, REGION, timeout_s=0.2) is None  # joins the refresh in flight
        assert time.perf_counter() - start < 1.0
        assert provider.fetches == 1
        assert len(warnings) == 1 and "no answer within 0.2 s" in warnings[0]
    finally:
        provider.release.set()
    _wait_for(lambda: _price_of(cache) == 10.0)
    cache.close()
    fetches = provider.fetches
    clock.now_s += 100
    assert _price_of(cache) == 10.0
    time.sleep(0.05)
    assert provider.fetches == fetches  # closed: no more refreshes


# --- the policy ----------------------------------------------------------------------------------------------------


def _quote(usd_per_hour: float, stale: bool = False) -> SpotQuote:
    return SpotQuote(
        usd_per_hour=usd_per_hour,
        instance_type=TYPE,
        region=REGION,
        availability_zone="us-east-1a",
        provider="test",
        fetched_at_unix=0.0,
        stale=stale,
    )


@pytest.mark.parametrize(
    ("usd_per_hour", "action", "code"),
    [(12.4, "pause", 1.0), (10.0001, "pause", 1.0), (10.0, "continue", 0.0), (6.0, "continue", 0.0),
     (4.0, "continue", 0.0), (3.9999, "scale_up", 2.0), (0.5, "scale_up", 2.0)],
)  # fmt: skip
def test_policy_thresholds(usd_per_hour: float, action: str, code: float) -> None:
    policy = SpotPolicy(pause_above_usd_per_hour=10.0, scale_up_below_usd_per_hour=4.0)
    decision = policy.decide(_quote(usd_per_hour))
    assert (decision.action, decision.usd_per_hour) == (action, usd_per_hour)
    assert decision.as_metrics() == {"spot_price_usd_per_hour": usd_per_hour, "spot_decision": code}
    assert "\n" not in decision.reason


def test_policy_reasons() -> None:
    policy = SpotPolicy(pause_above_usd_per_hour=10.0)
    assert policy.decide(_quote(12.4)).reason == (
        "spot price $12.40/h (p5.48xlarge, us-east-1) is above the pause threshold $10.00/h"
    )
    stale = policy.decide(_quote(12.4, stale=True))
    assert stale.action == "pause" and "stale" in stale.reason
    unknown = policy.decide(None)
    assert (unknown.action, unknown.usd_per_hour) == ("continue", None)
    assert "unknown" in unknown.reason
    assert unknown.as_metrics() == {"spot_price_usd_per_hour": None, "spot_decision": 0.0}
    assert SpotPolicy().decide(_quote(1e9)).action == "continue"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"pause_above_usd_per_hour": 0.0}, "pause_above_usd_per_hour"),
        ({"pause_above_usd_per_hour": -1.0}, "pause_above_usd_per_hour"),
        ({"scale_up_below_usd_per_hour": float("nan")}, "scale_up_below_usd_per_hour"),
        ({"scale_up_below_usd_per_hour": True}, "scale_up_below_usd_per_hour"),
        (
            {"pause_above_usd_per_hour": 5.0, "scale_up_below_usd_per_hour": 5.0},
            "scale_up_below_usd_per_hour",
        ),
        (
            {"pause_above_usd_per_hour": 5.0, "scale_up_below_usd_per_hour": 6.0},
            "scale_up_below_usd_per_hour",
        ),
    ],
)
def test_policy_validation(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        SpotPolicy(**kwargs)
    assert caught.value.field == field and str(caught.value).startswith(f"{field}: ")


def test_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the shipped providers (test files, e.g. test_cost_budget.py, register their own at import)
    shipped = {name: spot._PROVIDERS[name] for name in ("aws", "azure", "gcp")}
    monkeypatch.setattr(spot, "_PROVIDERS", shipped)  # leave the real registry as it was
    with pytest.raises(UserInputError, match=r"unknown spot price provider 'nope'; known: aws, azure, gcp$"):
        spot_provider("nope")
    aws = spot_provider("aws", timeout_s=1.0, availability_zone="us-east-1a")
    assert isinstance(aws, AwsSpotPrices) and aws.timeout_s == 1.0 and aws.name == "aws"
    register_spot_provider("fixed", _Provider)
    fixed = spot_provider("fixed", usd_per_hour=3.0)
    assert fixed.fetch(TYPE, REGION).usd_per_hour == 3.0
    with pytest.raises(ValueError, match="already registered"):
        register_spot_provider("aws", AwsSpotPrices)
    with pytest.raises(ConfigError, match="timeout_s"):
        spot_provider("aws", timeout_s=0)
