"""A run paused by the spot policy (exit 4) is not trained again while the price is still above the threshold: its
resume checks the price before any training and exits 4 at once, "nothing trained" (as a budget stop's resume exits 3).
That holds for a person rerunning the command and for torchrun's --max-restarts, which restarts on any non-zero
exit. Prices come from a real Azure Retail Prices-shaped server on 127.0.0.1 whose price the test sets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SIZE, REGION = "Standard_ND96isr_H100_v5", "eastus"
HINT = "run the same command to resume once the spot price is lower (or raise cost.spot_pause_above_usd_per_hour)"


class _Prices(ThreadingHTTPServer):
    spot_usd_per_hour = 100.0
    requests = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Prices

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests += 1
        price = self.server.spot_usd_per_hour
        item = {"currencyCode": "USD", "retailPrice": price, "unitPrice": price, "armRegionName": REGION,
                "location": "US East", "effectiveStartDate": "2026-01-01T00:00:00Z",
                "meterName": "ND96isr H100 v5 Spot", "productName": "Virtual Machines NDsr H100 v5 Series",
                "skuName": "ND96isr H100 v5 Spot", "serviceName": "Virtual Machines", "unitOfMeasure": "1 Hour",
                "type": "Consumption", "isPrimaryMeterRegion": True, "armSkuName": SIZE, "tierMinimumUnits": 0.0}  # fmt: skip
        data = json.dumps({"Items": [item], "NextPageLink": None, "Count": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def prices() -> Iterator[_Prices]:
    server = _Prices(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _train(prices: _Prices, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--no-progress", "--sample-tokens",
         "0", "--train.threads", "2", "--model.num_layers", "1", "--train.val_every_steps", "0",
         "--train.log_every_steps", "1", "--train.max_steps", "40", "--checkpoint.every_steps", "2",
         "--cost.pricing", "spot", "--cost.spot_provider", "azure", "--cost.instance", f"azure/{SIZE}/{REGION}",
         "--cost.price_usd_per_hour", "30", "--cost.spot_pause_above_usd_per_hour", "40",
         "--cost.spot_endpoint_url", f"http://127.0.0.1:{prices.server_address[1]}/api/retail/prices", *args],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip


def _refusal(checkpoint: str) -> str:
    return (
        f"spot pause: spot price $100.00/h ({SIZE}, {REGION}) is above the pause threshold $40.00/h "
        f"(cost.spot_pause_above_usd_per_hour) before resuming from checkpoint {checkpoint}; nothing trained; "
        f"exit 4 — {HINT}"
    )


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step-*"))


def test_rerunning_a_paused_run_trains_nothing_until_the_price_is_lower(
    prices: _Prices, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    first = _train(prices, out)
    assert first.returncode == 4, first.stderr[-3000:]
    # the pause's checkpoint is the newest: at the step boundary where the first quote was in (step 1 or 2, a few
    # steps later on a loaded machine)
    paused = _checkpoints(out)
    assert paused and paused[-1] < "step-00000040"
    metrics, summary = (out / "metrics.jsonl").read_bytes(), (out / "summary.json").read_bytes()

    again = _train(prices, out)  # the same command while the price is still $100/h
    assert again.returncode == 4, again.stderr[-3000:]
    assert (again.stdout, again.stderr.strip().splitlines()[-1]) == ("", _refusal(paused[-1]))
    assert _checkpoints(out) == paused  # nothing trained, nothing written
    assert (out / "metrics.jsonl").read_bytes() == metrics and (out / "summary.json").read_bytes() == summary

    prices.spot_usd_per_hour = 20.0  # the price fell: the same command resumes and finishes
    done = _train(prices, out)
    assert done.returncode == 0, done.stderr[-3000:]
    final = json.loads((out / "summary.json").read_text())
    assert final["steps"] == 40 and final["stop_exit_code"] is None


@pytest.mark.distributed
@pytest.mark.slow
def test_max_restarts_does_not_train_a_paused_run_again(prices: _Prices, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = _train(prices, out, "--parallel.nproc_per_node", "2", "--parallel.max_restarts", "1")
    assert run.returncode == 4, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    paused = f"step-{summary['steps']:08d}"
    assert summary["steps"] < 40 and summary["stop_exit_code"] == 4  # the pause, not a later attempt's finish
    assert _checkpoints(out)[-1] == paused  # nothing after the pause's checkpoint
    assert _refusal(paused) in run.stderr, run.stderr[
        -3000:
    ]  # the restarted group was refused before training
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == summary["steps"]


def _series(url: str) -> dict[str, float]:
    """The gaudi3_* series one rank's /metrics serves, by name (its device series aside)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    lines = [line for line in text.splitlines() if line.startswith("gaudi3_") and "device=" not in line]
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


@pytest.mark.distributed
def test_two_ranks_export_one_cost_the_live_quotes_rate(prices: _Prices, tmp_path: Path) -> None:
    """Only rank 0 polls the price ($20/h here, $30/h to start with): its meter is the run's cost (what the stops,
    checkpoints and summary use), so it alone exports the cost series; rank 1 exports none, rather than a cost at
    the starting rate that the dashboard's `max by (run)` would show instead."""
    prices.spot_usd_per_hour = 20.0
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--no-progress", "--sample-tokens",
         "0", "--nproc-per-node", "2", "--parallel.strategy", "ddp", "--train.threads", "1", "--model.num_layers",
         "1", "--train.val_every_steps", "0", "--train.log_every_steps", "1", "--train.max_steps", "100000",
         "--checkpoint.every_steps", "0", "--monitor.metrics_port", "0", "--cost.pricing", "spot",
         "--cost.spot_provider", "azure", "--cost.instance", f"azure/{SIZE}/{REGION}", "--cost.price_usd_per_hour",
         "30", "--cost.spot_endpoint_url", f"http://127.0.0.1:{prices.server_address[1]}/api/retail/prices"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        endpoints = [out / "metrics_endpoints" / f"rank-{rank}.json" for rank in (0, 1)]
        deadline, scraped = time.monotonic() + 180, [{}, {}]
        while time.monotonic() < deadline and proc.poll() is None:
            if all(path.is_file() for path in endpoints):
                urls = [json.loads(path.read_text())["url"] for path in endpoints]
                scraped = [_series(url) for url in urls]  # rank 1 after rank 0: it has had its records too
                if scraped[0].get("gaudi3_cost_usd_per_hour") == 20.0:
                    break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    assert scraped[0].get("gaudi3_cost_usd_per_hour") == 20.0 and scraped[0]["gaudi3_cost_usd"] > 0, scraped
    assert scraped[1].get("gaudi3_train_step", 0) > 0, scraped  # rank 1 has exported its records
    assert not [name for name in scraped[1] if name.startswith("gaudi3_cost")], scraped
