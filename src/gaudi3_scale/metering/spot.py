"""Spot prices: recent prices from a cloud API, cached off the training thread, and a pause/continue/scale-up policy.

A provider (`AwsSpotPrices`, `azure_prices.AzureRetailPrices`, `gcp_prices.GcpCatalogPrices`, or any object with
`name` and `fetch(instance_type, region)`; see `register_spot_provider`) asks the cloud for the current spot price of
ONE instance (the whole node) in USD per hour. Providers whose API also lists pay-as-you-go prices (Azure, GCP) have
a sibling `fetch_on_demand` with the same signature (`OnDemandPriceProvider`); `fetch_price` picks either (these
and the quote and error types live in `metering.quotes`, re-exported here). AWS's DescribeSpotPriceHistory has spot
prices only: its on-demand prices are the catalog's.
`CachedSpotPrices` keeps the last quote per (instance type, region) and refreshes it in a daemon thread once it is
older than its TTL, so a training callback can ask at every step boundary without ever waiting on the network:
a slow or failing price API means an old (stale-marked) price or none, never a stalled or crashed run.
`SpotPolicy.decide` turns a quote into `continue`, `pause` (checkpoint and stop) or `scale_up` (a recommendation);
the caller logs the decision's reason and exports `SpotDecision.as_metrics()`.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from gaudi3_scale.config.core import check_positive
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.metering.quotes import (  # re-exported: the provider interface lives there
    OnDemandPriceProvider,
    SpotPriceError,
    SpotPriceProvider,
    SpotQuote,
    fetch_price,
)

__all__ = [
    "AwsSpotPrices",
    "CachedSpotPrices",
    "OnDemandPriceProvider",
    "SpotDecision",
    "SpotPolicy",
    "SpotPriceError",
    "SpotPriceProvider",
    "SpotQuote",
    "fetch_price",
    "register_spot_provider",
    "spot_provider",
]

log = logging.getLogger(__name__)


class AwsSpotPrices:
    """EC2 `DescribeSpotPriceHistory` through boto3 (the optional extra `spot`).

    Each availability zone has its own spot price. With `availability_zone` set, the quote is that zone's newest
    price; otherwise it is the HIGHEST newest price across the region's zones: the scheduler may place the instance
    in any of them, and a budget must not be undercounted. `lookback_s` bounds the history asked for (AWS also
    returns the price in effect at the start time, so a price that has not changed for days is still found).
    One attempt per call, bounded by `timeout_s` per connection and read: retrying is the cache's job, at its TTL.
    """

    name: str = "aws"

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        availability_zone: str | None = None,
        product_description: str = "Linux/UNIX",
        lookback_s: float = 3 * 3600,
        timeout_s: float = 5.0,
        client_factory: Callable[[str], Any] | None = None,
    ) -> None:
        check_positive("lookback_s", lookback_s)
        check_positive("timeout_s", timeout_s)
        self.endpoint_url = endpoint_url
        self.availability_zone = availability_zone
        self.product_description = product_description
        self.lookback_s = lookback_s
        self.timeout_s = timeout_s
        # region -> an ec2 client; None builds a boto3 client with endpoint_url and the timeouts above.
        self._client_factory = client_factory or self._boto3_client
        self._clients: dict[str, Any] = {}  # boto3 clients are thread-safe; creating them is not
        self._lock = threading.Lock()

    def fetch(self, instance_type: str, region: str) -> SpotQuote:
        where = f"aws spot price for {instance_type} in {region}"
        try:
            import boto3  # noqa: F401  (only to name the extra when it is missing)
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError:
            raise SpotPriceError(
                f"{where}: boto3 is not installed; pip install 'gaudi3-scale[spot]'"
            ) from None
        try:
            records = self._history(instance_type, region)
        except (BotoCoreError, ClientError, OSError) as exc:
            raise SpotPriceError(f"{where}: {type(exc).__name__}: {exc}") from exc
        zone, usd_per_hour = self._pick(records, where)
        return SpotQuote(
            usd_per_hour=usd_per_hour,
            instance_type=instance_type,
            region=region,
            availability_zone=zone,
            provider=self.name,
            fetched_at_unix=time.time(),
        )

    def _history(self, instance_type: str, region: str) -> list[dict[str, Any]]:
        with self._lock:
            if region not in self._clients:
                self._clients[region] = self._client_factory(region)
            client = self._clients[region]
        start = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=self.lookback_s)
        request: dict[str, Any] = {
            "InstanceTypes": [instance_type],
            "ProductDescriptions": [self.product_description],
            "StartTime": start,
        }
        if self.availability_zone is not None:
            request["AvailabilityZone"] = self.availability_zone
        records: list[dict[str, Any]] = []
        for page in client.get_paginator("describe_spot_price_history").paginate(**request):
            records.extend(page.get("SpotPriceHistory", []))
        return records

    def _pick(self, records: list[dict[str, Any]], where: str) -> tuple[str | None, float]:
        """(zone, price): the newest price per zone, then the asked-for zone's or the highest."""
        newest: dict[str | None, tuple[dt.datetime, float]] = {}
        for record in records:
            zone = record.get("AvailabilityZone")
            if self.availability_zone is not None and zone != self.availability_zone:
                continue  # AWS filters by zone already; a stand-in server may not
            try:
                usd_per_hour, stamp = float(record["SpotPrice"]), record["Timestamp"]
            except (KeyError, TypeError, ValueError):
                raise SpotPriceError(f"{where}: unreadable record {record!r}") from None
            if not math.isfinite(usd_per_hour) or usd_per_hour <= 0:
                raise SpotPriceError(f"{where}: SpotPrice must be a positive number, got {usd_per_hour}")
            stamped = (stamp, usd_per_hour)  # same time, two products: the higher price
            if zone not in newest or stamped > newest[zone]:
                newest[zone] = stamped
        if not newest:
            zone_text = f" (zone {self.availability_zone})" if self.availability_zone else ""
            raise SpotPriceError(
                f"{where}{zone_text}: no {self.product_description!r} prices in the last {self.lookback_s:g} s"
            )
        zone = max(newest, key=lambda z: newest[z][1])
        return zone, newest[zone][1]

    def _boto3_client(self, region: str) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=self.timeout_s,
            read_timeout=self.timeout_s,
            retries={"total_max_attempts": 1},  # one attempt, no retries
        )
        # A session of our own: boto3's default session is not safe to create clients from in several threads.
        session = boto3.session.Session()
        return session.client("ec2", region_name=region, endpoint_url=self.endpoint_url, config=config)


_PROVIDERS: dict[str, Callable[..., SpotPriceProvider]] = {}


def register_spot_provider(name: str, factory: Callable[..., SpotPriceProvider]) -> None:
    """Add a provider: `factory(**kwargs)` builds it (kwargs from `spot_provider`); names are unique."""
    if name in _PROVIDERS:
        raise ValueError(f"spot price provider {name!r} is already registered")
    _PROVIDERS[name] = factory


def spot_provider(name: str, **kwargs: Any) -> SpotPriceProvider:
    if name not in _PROVIDERS:
        raise UserInputError(f"unknown spot price provider {name!r}; known: {', '.join(sorted(_PROVIDERS))}")
    return _PROVIDERS[name](**kwargs)


def _azure(**kwargs: Any) -> SpotPriceProvider:
    from gaudi3_scale.metering.azure_prices import AzureRetailPrices  # urllib & co. only when asked for

    return AzureRetailPrices(**kwargs)


def _gcp(**kwargs: Any) -> SpotPriceProvider:
    from gaudi3_scale.metering.gcp_prices import GcpCatalogPrices

    return GcpCatalogPrices(**kwargs)


register_spot_provider("aws", AwsSpotPrices)
register_spot_provider("azure", _azure)
register_spot_provider("gcp", _gcp)


@dataclass
class _Entry:
    quote: SpotQuote | None = None
    attempted_at: float | None = None  # clock() when the last refresh began
    refreshing: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)  # set when that refresh has finished


class CachedSpotPrices:
    """The last quote per (instance type, region), refreshed in the background at most once per `ttl_s`.

    `price()` never blocks on the network and never raises, so a training loop can call it at every checkpoint
    boundary. A refresh starts when the last one began `ttl_s` ago or more (or never ran), so a failing API is
    asked at most once per TTL as well; a failed refresh keeps the old quote, marked `stale=True`, and calls
    `warn` once per distinct failure message (default: a logging warning).
    """

    def __init__(
        self,
        provider: SpotPriceProvider,
        *,
        ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        check_positive("ttl_s", ttl_s)
        self.provider = provider
        self.ttl_s = ttl_s
        self._clock = clock
        self._warn = warn or log.warning
        self._warned: set[str] = set()
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._lock = threading.Lock()
        self._closed = False

    def price(self, instance_type: str, region: str) -> SpotQuote | None:
        """The cached quote (fresh, or stale after a failed refresh), or None before the first good fetch."""
        key = (instance_type, region)
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            due = entry.attempted_at is None or self._clock() - entry.attempted_at >= self.ttl_s
            failure = None
            if due and entry.refreshing is None and not self._closed:
                failure = self._start(key, entry)
            quote = entry.quote
        if failure is not None:
            self._warn_once(failure)
        return quote

    def refresh_now(
        self, instance_type: str, region: str, timeout_s: float | None = None
    ) -> SpotQuote | None:
        """Fetch now and wait (at most `timeout_s`; None: the provider's own timeout) for CLIs and tests.

        Returns the new quote; on failure or timeout the last good one marked stale, or None. A refresh already
        in flight for this key is waited for rather than doubled.
        """
        key = (instance_type, region)
        with self._lock:
            if self._closed:
                raise RuntimeError("CachedSpotPrices.refresh_now after close()")
            entry = self._entries.setdefault(key, _Entry())
            failure = self._start(key, entry) if entry.refreshing is None else None
            done = entry.done
        if failure is not None:
            self._warn_once(failure)
        if not done.wait(timeout_s):
            self._warn_once(
                f"{self.provider.name} spot price for {instance_type} in {region}: no answer within "
                f"{timeout_s:g} s (training continues)"
            )
        with self._lock:
            quote = entry.quote
        if quote is not None and not done.is_set():
            quote = replace(quote, stale=True)
        return quote

    def close(self) -> None:
        """Start no more refreshes; one in flight finishes in its daemon thread and is not waited for."""
        with self._lock:
            self._closed = True

    def _start(self, key: tuple[str, str], entry: _Entry) -> str | None:
        """Begin a refresh (the lock is held); a failure to start one comes back as a message."""
        entry.attempted_at = self._clock()
        entry.done = threading.Event()
        thread = threading.Thread(
            target=self._refresh, args=(key, entry), name="gaudi3-spot-price", daemon=True
        )
        entry.refreshing = thread
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread": no price this time, training goes on
            entry.refreshing = None
            entry.done.set()
            return f"spot price refresh for {key[0]} in {key[1]} could not start: {exc}"
        return None

    def _refresh(self, key: tuple[str, str], entry: _Entry) -> None:
        error = None
        try:
            quote: SpotQuote | None = self.provider.fetch(*key)
        except SpotPriceError as exc:
            quote, error = None, str(exc)
        except Exception as exc:  # a broken provider must not stop training either; it is reported below
            quote, error = (
                None,
                f"{self.provider.name} spot price for {key[0]} in {key[1]}: {type(exc).__name__}: {exc}",
            )
        with self._lock:
            if quote is not None:
                entry.quote = quote
            elif entry.quote is not None and not entry.quote.stale:
                entry.quote = replace(entry.quote, stale=True)
            entry.refreshing = None
            entry.done.set()
            closed = self._closed
        if error is not None and not closed:
            self._warn_once(f"{error} (training continues)")

    def _warn_once(self, message: str) -> None:
        message = " ".join(message.split())
        with self._lock:
            if message in self._warned:
                return
            self._warned.add(message)
        self._warn(message)


_ACTION_CODES = {"continue": 0.0, "pause": 1.0, "scale_up": 2.0}  # the `spot_decision` metric's values


@dataclass(frozen=True, kw_only=True)
class SpotDecision:
    action: Literal["continue", "pause", "scale_up"]
    usd_per_hour: float | None  # the price decided on; None: unknown
    reason: str  # one human line

    def as_metrics(self) -> dict[str, float | None]:
        """`spot_decision`: 0 continue, 1 pause, 2 scale_up."""
        return {"spot_price_usd_per_hour": self.usd_per_hour, "spot_decision": _ACTION_CODES[self.action]}


def _usd(value: float) -> str:
    return f"${value:,.2f}" if value >= 0.01 else f"${value:.3g}"  # placeholder prices are far below a cent


@dataclass(frozen=True, kw_only=True)
class SpotPolicy:
    """What to do at a step boundary, given the current spot price of one node."""

    pause_above_usd_per_hour: float | None = field(
        default=None,
        metadata={
            "help": "checkpoint and stop when the spot price of one node is above this (USD/h); null: never"
        },
    )
    scale_up_below_usd_per_hour: float | None = field(
        default=None,
        metadata={
            "help": "recommend more nodes when the spot price of one node is below this (USD/h); null: never"
        },
    )

    def __post_init__(self) -> None:
        for name in ("pause_above_usd_per_hour", "scale_up_below_usd_per_hour"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            ):
                raise ConfigError(name, f"must be a number or null, got {value!r}")
            check_positive(name, value)
        pause, scale_up = self.pause_above_usd_per_hour, self.scale_up_below_usd_per_hour
        if pause is not None and scale_up is not None and not scale_up < pause:
            raise ConfigError(
                "scale_up_below_usd_per_hour",
                f"must be below pause_above_usd_per_hour ({pause}), got {scale_up}",
            )

    def decide(self, quote: SpotQuote | None) -> SpotDecision:
        """Pause strictly above the pause threshold, scale up strictly below the other, else continue."""
        if quote is None:
            return SpotDecision(
                action="continue",
                usd_per_hour=None,
                reason="spot price unknown (none fetched yet); continuing",
            )
        price = quote.usd_per_hour
        stale = "; stale, the latest refresh failed" if quote.stale else ""
        what = f"spot price {_usd(price)}/h ({quote.instance_type}, {quote.region}{stale})"
        pause, scale_up = self.pause_above_usd_per_hour, self.scale_up_below_usd_per_hour
        if pause is not None and price > pause:
            return SpotDecision(
                action="pause",
                usd_per_hour=price,
                reason=f"{what} is above the pause threshold {_usd(pause)}/h",
            )
        if scale_up is not None and price < scale_up:
            return SpotDecision(
                action="scale_up",
                usd_per_hour=price,
                reason=f"{what} is below the scale-up threshold {_usd(scale_up)}/h",
            )
        limits = [f"pause above {_usd(pause)}/h" if pause is not None else "",
                  f"scale up below {_usd(scale_up)}/h" if scale_up is not None else ""]  # fmt: skip
        within = ", ".join(x for x in limits if x) or "no thresholds set"
        return SpotDecision(action="continue", usd_per_hour=price, reason=f"{what}: continuing ({within})")
