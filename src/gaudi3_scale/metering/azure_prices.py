"""Azure VM prices from the public Azure Retail Prices API: spot and pay-as-you-go, per VM size and region, no auth.

`GET {endpoint}?$filter=serviceName eq 'Virtual Machines' and armRegionName eq '<region>' and armSkuName eq
'<size>' and priceType eq 'Consumption'` answers `{"Items": [...], "NextPageLink": <url or null>}` (Microsoft Learn,
"Azure Retail Prices overview", learn.microsoft.com/rest/api/cost-management/retail-prices/azure-retail-prices, read
2026-11-26). One item is one meter: `retailPrice` in `currencyCode` per `unitOfMeasure` ("1 Hour"), with `skuName`,
`productName`, `type` and `effectiveStartDate`. Spot meters carry "Spot" in `skuName`, Azure Batch's low-priority ones
"Low Priority" (never ours), Windows meters "Windows" in `productName` (we run Linux). Pay-as-you-go is the meter
with neither.

Like `AwsSpotPrices`, the quote is the newest price per meter, then the HIGHEST across meters when several match
(a budget must not be undercounted). Azure prices a VM size per region, so there is no zone to choose.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from typing import Any, Literal
from urllib.parse import urlencode

from gaudi3_scale.config.core import check_positive
from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.metering.price_http import MAX_PAGES, get_json, same_origin
from gaudi3_scale.metering.quotes import BothPricings, SpotPriceError, SpotQuote

__all__ = ["AZURE_RETAIL_PRICES_URL", "AzureRetailPrices"]

AZURE_RETAIL_PRICES_URL = "https://prices.azure.com/api/retail/prices"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # ARM names; also keeps quotes out of the OData filter


def _check_name(what: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise UserInputError(
            f"azure {what} must be an ARM name (letters, digits, '_', '-', '.'; e.g. Standard_ND96isr_H100_v5 in "
            f"eastus), got {brief(value)}"
        )


class AzureRetailPrices(BothPricings):
    """The Azure Retail Prices API through urllib; `endpoint_url` replaces the public endpoint (tests, mirrors).

    One attempt per call, each request bounded by `timeout_s` per connection and read; retrying is the cache's job.
    """

    name: str = "azure"

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        availability_zone: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        if availability_zone is not None:
            raise UserInputError(
                f"azure prices a VM size per region, not per zone: leave the availability zone unset "
                f"(got {brief(availability_zone)})"
            )
        check_positive("timeout_s", timeout_s)
        self.endpoint_url = endpoint_url or AZURE_RETAIL_PRICES_URL
        self.timeout_s = timeout_s

    def check_instance(self, instance_type: str, region: str) -> None:
        """Bad names are bad input (UserInputError), found before anything is fetched."""
        _check_name("VM size", instance_type)
        _check_name("region", region)

    def _quote(self, instance_type: str, region: str, pricing: Literal["spot", "on_demand"]) -> SpotQuote:
        self.check_instance(instance_type, region)
        where = f"azure {pricing.replace('_', '-')} price for {instance_type} in {region}"
        items = self._items(instance_type, region, where)
        meter, usd_per_hour = self._pick(items, instance_type, region, pricing, where)
        return SpotQuote(
            usd_per_hour=usd_per_hour,
            instance_type=instance_type,
            region=region,
            availability_zone=None,
            provider=self.name,
            fetched_at_unix=time.time(),
            pricing=pricing,
            priced_as=meter,
        )

    def _items(self, instance_type: str, region: str, where: str) -> list[Any]:
        odata = (
            f"serviceName eq 'Virtual Machines' and armRegionName eq '{region}' "
            f"and armSkuName eq '{instance_type}' and priceType eq 'Consumption'"
        )
        url: str | None = f"{self.endpoint_url}?{urlencode({'$filter': odata})}"
        items: list[Any] = []
        for _ in range(MAX_PAGES):
            assert url is not None
            page = get_json(url, where=where, timeout_s=self.timeout_s)
            if not isinstance(page.get("Items"), list):
                raise SpotPriceError(
                    f"{where}: unexpected answer: no 'Items' list (keys: {sorted(page)[:8]})"
                )
            items.extend(page["Items"])
            url = page.get("NextPageLink")
            if not url:
                return items
            if not isinstance(url, str) or not same_origin(url, self.endpoint_url):
                raise SpotPriceError(f"{where}: NextPageLink {brief(url)} leaves {self.endpoint_url}")
        raise SpotPriceError(f"{where}: still more pages after {MAX_PAGES}")

    @staticmethod
    def _pick(
        items: list[Any], instance_type: str, region: str, pricing: str, where: str
    ) -> tuple[str, float]:
        """(meter name, price): the newest price per meter among the matching ones, then the highest."""
        newest: dict[str, tuple[dt.datetime, float, str]] = {}
        for item in items:
            if not isinstance(item, dict):
                raise SpotPriceError(f"{where}: unreadable item {brief(item)}")
            wanted = (  # the API filters already; a stand-in server or a future API may not
                item.get("armSkuName") == instance_type
                and item.get("armRegionName") == region
                and item.get("type") == "Consumption"
                and item.get("unitOfMeasure") == "1 Hour"
                and "Windows" not in str(item.get("productName", ""))
                and "Low Priority" not in str(item.get("skuName", ""))
                and ("Spot" in str(item.get("skuName", ""))) == (pricing == "spot")
            )
            if not wanted:
                continue
            stamped = _read(item, where)
            meter = str(item.get("meterId") or item.get("meterName") or item.get("skuName"))
            if meter not in newest or stamped > newest[meter]:
                newest[meter] = stamped
        if not newest:
            kind = "spot" if pricing == "spot" else "pay-as-you-go"
            raise SpotPriceError(
                f"{where}: no Linux {kind} hourly price among {len(items)} item(s) (is the size sold there?)"
            )
        _, usd_per_hour, name = max(newest.values(), key=lambda v: v[1])
        return name, usd_per_hour


def _read(item: dict[str, Any], where: str) -> tuple[dt.datetime, float, str]:
    """(effective start, USD per hour, meter name) of one item; anything unreadable is a SpotPriceError."""
    price, currency = item.get("retailPrice"), item.get("currencyCode", "USD")
    if currency != "USD":
        raise SpotPriceError(f"{where}: price in {brief(currency)}, expected USD")
    if (
        isinstance(price, bool)
        or not isinstance(price, int | float)
        or not math.isfinite(price)
        or price <= 0
    ):
        raise SpotPriceError(f"{where}: retailPrice must be a positive number, got {brief(price)}")
    try:
        start = dt.datetime.fromisoformat(str(item["effectiveStartDate"]))
    except (KeyError, ValueError):
        raise SpotPriceError(f"{where}: unreadable effectiveStartDate in {brief(item)}") from None
    if start.tzinfo is None:
        start = start.replace(tzinfo=dt.UTC)
    return start, float(price), str(item.get("meterName") or item.get("skuName"))
