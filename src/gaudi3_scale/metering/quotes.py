"""The price provider interface: a quote, the one error, and spot / on-demand fetching.

`SpotPriceProvider` is `name` + `fetch(instance_type, region)` (the spot price of ONE instance, the whole node, in
USD per hour). A provider whose API also lists pay-as-you-go prices has the sibling `fetch_on_demand`
(`OnDemandPriceProvider`); `fetch_price` picks either. A sibling method rather than a `pricing` argument keeps every
provider written for spot alone valid. Everything here is re-exported by `metering.spot`, where the registry, the
cache and the policy live; the providers (`spot.AwsSpotPrices`, `azure_prices`, `gcp_prices`) import from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = [
    "BothPricings",
    "OnDemandPriceProvider",
    "SpotPriceError",
    "SpotPriceProvider",
    "SpotQuote",
    "fetch_price",
]

Pricing = Literal["spot", "on_demand"]


class SpotPriceError(Exception):
    """A provider could not give a price; the message is one line saying what failed."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # botocore messages may span lines


@dataclass(frozen=True, kw_only=True)
class SpotQuote:
    usd_per_hour: float  # price of ONE instance (the whole node), USD/h
    instance_type: str
    region: str
    availability_zone: str | None  # the zone the price is from; None: the provider does not say
    provider: str  # e.g. "aws"
    fetched_at_unix: float  # time.time() when fetched
    stale: bool = False  # True: the last good value, returned because a refresh failed
    pricing: Literal["spot", "on_demand"] = "spot"  # fetch gives spot quotes, fetch_on_demand on_demand ones
    priced_as: str | None = None  # what the provider priced (an Azure meter, GCP SKUs); None: the type itself


class SpotPriceProvider(Protocol):
    name: str

    def fetch(self, instance_type: str, region: str) -> SpotQuote:
        """The current spot price; raises SpotPriceError when there is none to be had."""
        ...


class OnDemandPriceProvider(SpotPriceProvider, Protocol):
    def fetch_on_demand(self, instance_type: str, region: str) -> SpotQuote:
        """The current on-demand (pay-as-you-go) price; raises SpotPriceError when there is none to be had."""
        ...


class BothPricings:
    """A provider whose API answers both pricings with one query (`_quote`): `fetch` and `fetch_on_demand` are it."""

    def _quote(self, instance_type: str, region: str, pricing: Pricing) -> SpotQuote:
        raise NotImplementedError

    def fetch(self, instance_type: str, region: str) -> SpotQuote:
        return self._quote(instance_type, region, "spot")

    def fetch_on_demand(self, instance_type: str, region: str) -> SpotQuote:
        return self._quote(instance_type, region, "on_demand")


def fetch_price(
    provider: SpotPriceProvider, instance_type: str, region: str, pricing: Literal["spot", "on_demand"]
) -> SpotQuote:
    """`provider.fetch` for spot, `fetch_on_demand` for on-demand (a provider without it is a SpotPriceError)."""
    if pricing == "spot":
        return provider.fetch(instance_type, region)
    on_demand = getattr(provider, "fetch_on_demand", None)
    if on_demand is None:
        raise SpotPriceError(
            f"{provider.name} gives spot prices only; on-demand prices come from the instance catalog "
            "(gaudi3 cost catalog) or cost.price_usd_per_hour"
        )
    quote: SpotQuote = on_demand(instance_type, region)
    return quote
