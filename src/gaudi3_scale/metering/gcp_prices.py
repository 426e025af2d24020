"""GCP Compute Engine prices from the Cloud Billing Catalog API: a sum of SKUs, each COUNT × its hourly price.

`GET {endpoint}?currencyCode=USD&pageSize=5000[&pageToken=…]` with the API key in the `X-Goog-Api-Key` header lists
the public SKUs of Compute Engine (service 6F81-5844-456A) as `{"skus": [...], "nextPageToken": "…"}` (Google Cloud,
"Get Google Cloud pricing information" catalog-api how-to and googleapis `google/cloud/billing/v1/
cloud_catalog.proto`; "Use API keys to access APIs" for the header; read 2026-11-26). A SKU has a `description`,
`category.usageType` ("OnDemand"; spot VMs are "Preemptible"), `serviceRegions`, and `pricingInfo` (a timeline)
whose `pricingExpression.tieredRates[].unitPrice` is `{units, nanos}` per `usageUnit` ("h", "GiBy.h").

GCP bills accelerators, vCPUs and memory as separate SKUs, so a machine's price is a sum; which SKUs, and how many of
each, make up a machine type (a3-highgpu-8g: 8 GPUs, plus cores and RAM?) is not in any source we could cite, so no
composition is shipped. The instance type names the parts: ``COUNT*DESCRIPTION[+COUNT*DESCRIPTION…]``, e.g.
``8*<GPU SKU description>`` (the GPUs alone: a lower bound of the machine's price). Each DESCRIPTION matches the SKUs
whose description contains it (case-insensitive) offered in the region, of the usage type asked for; per SKU the
newest pricing, across matching SKUs the HIGHEST (as `AwsSpotPrices` takes the highest zone). The whole catalog is
read for each quote (the v1 API has no filter), so keep `cost.spot_ttl_s` at minutes, not seconds.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Literal
from urllib.parse import urlencode

from gaudi3_scale.config.core import check_positive
from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.metering.price_http import MAX_PAGES, get_json
from gaudi3_scale.metering.quotes import BothPricings, SpotPriceError, SpotQuote

__all__ = ["API_KEY_ENV", "COMPUTE_ENGINE_SKUS_URL", "GcpCatalogPrices", "parse_parts"]

COMPUTE_ENGINE_SKUS_URL = "https://cloudbilling.googleapis.com/v1/services/6F81-5844-456A/skus"
API_KEY_ENV = "GOOGLE_CLOUD_API_KEY"  # the key is read from here, never from a config file
_USAGE = {"spot": "Preemptible", "on_demand": "OnDemand"}
_FORM = "COUNT*SKU description[+COUNT*SKU description…], e.g. '8*<GPU SKU description>'"


def parse_parts(instance_type: str) -> list[tuple[float, str]]:
    """`8*A + 1.5*B` → [(8.0, 'A'), (1.5, 'B')]; anything else is a UserInputError saying the form."""
    if "*" not in instance_type:
        raise UserInputError(
            f"gcp prices SKUs, not machine types: give the instance type as {_FORM}; which SKUs make up "
            f"{brief(instance_type)} is not in a sourced table (docs/cost.md)"
        )
    parts = []
    for term in instance_type.split("+"):
        count_text, _, description = term.partition("*")
        try:
            count = float(count_text)
        except ValueError:
            count = math.nan
        if not math.isfinite(count) or count <= 0 or not description.strip():
            raise UserInputError(f"gcp instance type term {brief(term.strip())}: expected {_FORM}")
        parts.append((count, description.strip()))
    return parts


class GcpCatalogPrices(BothPricings):
    """The Cloud Billing Catalog API through urllib; the API key comes from the environment variable `api_key_env`.

    A missing key is bad input (UserInputError) at construction, so a run refuses to start rather than warn later.
    """

    name: str = "gcp"

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        availability_zone: str | None = None,
        api_key_env: str = API_KEY_ENV,
        timeout_s: float = 10.0,
        page_size: int = 5000,
    ) -> None:
        if availability_zone is not None:
            raise UserInputError(
                f"gcp SKUs are priced per region, not per zone: leave the availability zone unset "
                f"(got {brief(availability_zone)})"
            )
        check_positive("timeout_s", timeout_s)
        check_positive("page_size", page_size)
        self._api_key = os.environ.get(api_key_env, "").strip()
        if not self._api_key:
            raise UserInputError(
                f"gcp prices need a Cloud Billing Catalog API key in the environment variable {api_key_env} "
                "(it is never read from a config file)"
            )
        self.endpoint_url = endpoint_url or COMPUTE_ENGINE_SKUS_URL
        self.timeout_s = timeout_s
        self.page_size = page_size

    def check_instance(self, instance_type: str, region: str) -> None:
        parse_parts(instance_type)

    def _quote(self, instance_type: str, region: str, pricing: Literal["spot", "on_demand"]) -> SpotQuote:
        parts = parse_parts(instance_type)
        where = f"gcp {pricing.replace('_', '-')} price for {instance_type} in {region}"
        skus = self._skus(where)
        usd_per_hour, priced = 0.0, []
        for count, description in parts:
            name, unit_usd = _pick(skus, description, region, _USAGE[pricing], where)
            usd_per_hour += count * unit_usd
            priced.append(f"{count:g} × {name}")
        return SpotQuote(
            usd_per_hour=usd_per_hour,
            instance_type=instance_type,
            region=region,
            availability_zone=None,
            provider=self.name,
            fetched_at_unix=time.time(),
            pricing=pricing,
            priced_as=" + ".join(priced),
        )

    def _skus(self, where: str) -> list[Any]:
        skus: list[Any] = []
        token = ""
        for _ in range(MAX_PAGES):
            query = {"currencyCode": "USD", "pageSize": str(self.page_size)}
            if token:
                query["pageToken"] = token
            page = get_json(
                f"{self.endpoint_url}?{urlencode(query)}",
                where=where,
                timeout_s=self.timeout_s,
                headers={"X-Goog-Api-Key": self._api_key},
            )
            if not isinstance(page.get("skus", []), list):
                raise SpotPriceError(f"{where}: unexpected answer: 'skus' is not a list")
            skus.extend(page.get("skus", []))
            token = page.get("nextPageToken") or ""
            if not isinstance(token, str):
                raise SpotPriceError(f"{where}: unexpected nextPageToken {brief(token)}")
            if not token:
                return skus
        raise SpotPriceError(f"{where}: still more pages after {MAX_PAGES}")


def _pick(skus: list[Any], description: str, region: str, usage: str, where: str) -> tuple[str, float]:
    """(SKU description, USD per unit-hour): the highest newest price among the SKUs that match."""
    best: tuple[float, str] | None = None
    for sku in skus:
        if not isinstance(sku, dict) or not isinstance(sku.get("category"), dict):
            raise SpotPriceError(f"{where}: unreadable SKU {brief(sku)}")
        text = str(sku.get("description", ""))
        if (
            description.lower() not in text.lower()
            or sku["category"].get("usageType") != usage
            or region not in (sku.get("serviceRegions") or [])
        ):
            continue
        price = (_hourly_usd(sku, where), text)
        best = price if best is None or price > best else best
    if best is None:
        raise SpotPriceError(
            f"{where}: no {usage} SKU whose description contains {description!r} is offered in {region}"
        )
    return best[1], best[0]


def _hourly_usd(sku: dict[str, Any], where: str) -> float:
    """The newest pricing of one SKU: its highest tier rate, which must be per hour (per GiB-hour for RAM) in USD."""
    label = f"{where}: SKU {brief(sku.get('description'))}"
    try:
        info = max(sku["pricingInfo"], key=lambda p: str(p.get("effectiveTime", "")))
        expression = info["pricingExpression"]
        unit, rates = expression["usageUnit"], expression["tieredRates"]
        prices = [r["unitPrice"] for r in rates]
        usd = [int(p.get("units", 0)) + int(p.get("nanos", 0)) / 1e9 for p in prices]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise SpotPriceError(f"{label}: unreadable pricingInfo") from None
    if not str(unit).endswith("h"):
        raise SpotPriceError(f"{label}: priced per {brief(unit)}, not per hour")
    if any(p.get("currencyCode", "USD") != "USD" for p in prices):
        raise SpotPriceError(f"{label}: not priced in USD")
    if not usd or max(usd) <= 0:
        raise SpotPriceError(f"{label}: no positive price")
    return max(usd)
