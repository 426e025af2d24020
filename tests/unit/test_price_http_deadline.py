"""The price APIs' timeout is a deadline for the whole request, against a real server on 127.0.0.1 that sends its
answer one byte at a time: a per-read timeout never trips on it, so `gaudi3 cost quote` would hang and a run's
price refresh would never end (and its last quote never be marked stale)."""

from __future__ import annotations

import json
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gaudi3_scale.metering.azure_prices import AzureRetailPrices
from gaudi3_scale.metering.price_http import get_json
from gaudi3_scale.metering.spot import CachedSpotPrices, SpotPriceError

SIZE, REGION = "Standard_ND96isr_H100_v5", "eastus"
TIMEOUT_S = 1.0
ITEM = {"currencyCode": "USD", "retailPrice": 21.5, "unitPrice": 21.5, "armRegionName": REGION,
        "location": "US East", "effectiveStartDate": "2026-01-01T00:00:00Z", "meterName": "ND96isr H100 v5 Spot",
        "productName": "Virtual Machines NDsr H100 v5 Series", "skuName": "ND96isr H100 v5 Spot",
        "serviceName": "Virtual Machines", "unitOfMeasure": "1 Hour", "type": "Consumption",
        "isPrimaryMeterRegion": True, "armSkuName": SIZE, "tierMinimumUnits": 0.0}  # fmt: skip
ANSWER = json.dumps({"Items": [ITEM], "NextPageLink": None, "Count": 1}).encode()


class _Api(ThreadingHTTPServer):
    drip_s = (
        0.0  # > 0: every byte (status line, headers, body) is sent alone, this long after the previous one
    )
    drip_headers = False  # True: the status line and headers drip too, not only the body
    requests = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Api

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, data: bytes) -> None:
        for i in range(len(data)):
            self.wfile.write(data[i : i + 1])
            self.wfile.flush()
            time.sleep(self.server.drip_s)

    def do_GET(self) -> None:
        self.server.requests += 1
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(ANSWER)}\r\n\r\n".encode()
        try:
            if not self.server.drip_s:
                self.wfile.write(head + ANSWER)
            elif self.server.drip_headers:
                self._send(head + ANSWER)
            else:
                self.wfile.write(head)
                self._send(ANSWER)
        except OSError:  # the client gave up: expected
            pass


@pytest.fixture
def api() -> Iterator[_Api]:
    socketserver.TCPServer.allow_reuse_address = True
    server = _Api(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield server
    server.drip_s = 0.0
    server.shutdown()
    server.server_close()


def _url(api: _Api) -> str:
    return f"http://127.0.0.1:{api.server_address[1]}/api/retail/prices"


@pytest.mark.parametrize("drip_headers", [False, True], ids=["body-drips", "headers-drip"])
def test_a_slow_drip_answer_ends_at_the_deadline(api: _Api, drip_headers: bool) -> None:
    api.drip_s, api.drip_headers = (
        0.1,
        drip_headers,
    )  # each read returns within the timeout; the whole takes >50 s
    start = time.monotonic()
    with pytest.raises(SpotPriceError) as err:
        get_json(_url(api), where="azure test", timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert elapsed < 3 * TIMEOUT_S, elapsed
    assert str(err.value) == f"azure test: TimeoutError: timed out: no complete answer within {TIMEOUT_S:g} s"


def test_a_prompt_answer_is_read_whole(api: _Api) -> None:
    assert get_json(_url(api), where="azure test", timeout_s=TIMEOUT_S)["Items"][0]["retailPrice"] == 21.5


def test_a_run_keeps_its_last_quote_marked_stale_and_retries_after_a_slow_drip(api: _Api) -> None:
    warnings: list[str] = []
    cache = CachedSpotPrices(
        AzureRetailPrices(endpoint_url=_url(api), timeout_s=TIMEOUT_S), ttl_s=0.5, warn=warnings.append
    )
    first = cache.refresh_now(SIZE, REGION, timeout_s=10.0)
    assert first is not None and first.usd_per_hour == 21.5 and not first.stale
    api.drip_s = 0.1
    time.sleep(0.6)  # the quote is due again
    assert cache.price(SIZE, REGION) == first  # the refresh runs in the background: the last quote, at once
    deadline = time.monotonic() + 3 * TIMEOUT_S
    quote = cache.price(SIZE, REGION)
    while time.monotonic() < deadline and not (quote is not None and quote.stale):
        time.sleep(0.05)
        quote = cache.price(SIZE, REGION)
    assert quote is not None and quote.stale and quote.usd_per_hour == 21.5  # the refresh ended: marked stale
    assert warnings == [
        f"azure spot price for {SIZE} in {REGION}: TimeoutError: timed out: no complete answer within "
        f"{TIMEOUT_S:g} s (training continues)"
    ]
    time.sleep(0.6)
    cache.price(SIZE, REGION)
    assert api.requests >= 3  # and the next one was started a TTL later: no refresh stuck in flight
    cache.close()


def test_cost_quote_cli_ends_at_its_timeout(api: _Api) -> None:
    api.drip_s = 0.1
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "cost", "quote", "--provider", "azure", "--type", SIZE,
         "--region", REGION, "--endpoint-url", _url(api), "--timeout-s", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr == (
        f"gaudi3: error: azure spot price for {SIZE} in {REGION}: TimeoutError: timed out: no complete answer "
        "within 2 s\n"
    )
    assert elapsed < 3 * 2 + 5, elapsed  # + the interpreter's start
