"""The `cost` section of a run config: what a run's instances cost, its budget, and the spot-price policy.

Live cost tracking is on when a price can be resolved: `price_usd_per_hour`, or `instance` looked up in the catalog
(`metering.live.resolve_price`). Everything here is checked without reading the catalog; what needs it (is the instance
listed, is its price known) is checked when the run starts, before any rank is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from gaudi3_scale.config.core import check_choice
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.numbers import check_number, check_seconds
from gaudi3_scale.config.urls import check_http_url

__all__ = ["PRICINGS", "CostConfig"]

PRICINGS = ("on_demand", "spot", "capacity_block")
Pricing = Literal["on_demand", "spot", "capacity_block"]
_SPOT_ONLY = ("spot_pause_above_usd_per_hour", "spot_scale_up_below_usd_per_hour")
# Where live spot quotes come from: used only with pricing spot and an instance (`metering.live.uses_spot_quotes`).
# Set otherwise they would be ignored without a word, so they are refused like the policy's thresholds.
_QUOTE_SETTINGS = ("spot_provider", "spot_endpoint_url", "spot_availability_zone", "spot_ttl_s")
MAX_USD = 1e12  # a price or budget above a trillion dollars is a typo; its forecasts would print as inf


@dataclass(kw_only=True)
class CostConfig:
    instance: str | None = field(
        default=None,
        metadata={
            "help": "the instance every node runs on, as provider/type/region from the instance catalog, "
            "e.g. aws/p5.48xlarge/us-east-1; its price (see pricing) is the rate per node"
        },
    )
    pricing: Pricing = field(
        default="on_demand",
        metadata={
            "help": "which catalog price applies: on_demand, spot (the catalog range's HIGH end, conservative, "
            "until a live spot quote arrives) or capacity_block"
        },
    )
    price_usd_per_hour: float | None = field(
        default=None,
        metadata={
            "help": "explicit price per node in USD/h; wins over the catalog (with spot pricing a live quote "
            "replaces it once one arrives); needed for instances whose price the catalog does not know"
        },
    )
    catalog_file: str | None = field(
        default=None,
        metadata={"help": "YAML file of instances that extends or overrides the shipped catalog"},
    )
    budget_usd: float | None = field(
        default=None,
        metadata={
            "help": "stop cleanly (checkpoint, exit 3) once the run's accrued cost reaches this; the accrued "
            "cost is stored in every checkpoint, so a resumed run keeps counting; null = no budget"
        },
    )
    warn_at_fraction: float = field(
        default=0.8, metadata={"help": "warn once when the accrued cost passes this fraction of budget_usd"}
    )
    spot_provider: str = field(
        default="aws",
        metadata={
            "help": "where live spot prices come from (pricing spot): aws (boto3, AWS credentials), azure "
            "(Retail Prices API, no auth) or gcp (Cloud Billing Catalog, key in $GOOGLE_CLOUD_API_KEY; the "
            "instance type is COUNT*SKU description[+...]); see docs/cost.md"
        },
    )
    spot_endpoint_url: str | None = field(
        default=None, metadata={"help": "spot price API endpoint; null = the provider's default"}
    )
    spot_availability_zone: str | None = field(
        default=None,
        metadata={
            "help": "aws only: quote this availability zone; null = the highest price of the region's zones"
        },
    )
    spot_ttl_s: float = field(
        default=300.0, metadata={"help": "seconds a spot quote is reused before it is fetched again"}
    )
    spot_pause_above_usd_per_hour: float | None = field(
        default=None,
        metadata={
            "help": "pricing spot: at the next step boundary, checkpoint and stop cleanly (exit 4) when the spot "
            "price per node is above this (a resume is refused while it still is); null = never pause"
        },
    )
    spot_scale_up_below_usd_per_hour: float | None = field(
        default=None,
        metadata={
            "help": "pricing spot: recommend more nodes (one note when the price crosses it) when the spot price "
            "per node is below this; null = never recommend"
        },
    )

    def __post_init__(self) -> None:
        if self.instance is not None:
            parts = self.instance.split("/")
            if len(parts) != 3 or not all(p.strip() for p in parts):
                raise ConfigError(
                    "instance",
                    f"expected provider/type/region (e.g. aws/p5.48xlarge/us-east-1), got {self.instance!r}",
                )
        check_choice("pricing", self.pricing, PRICINGS)
        for name in ("price_usd_per_hour", "budget_usd", *_SPOT_ONLY):
            check_number(name, getattr(self, name), above=0, high=MAX_USD)
        check_seconds("spot_ttl_s", self.spot_ttl_s)
        check_http_url("spot_endpoint_url", self.spot_endpoint_url)
        if not 0 < self.warn_at_fraction < 1:
            raise ConfigError(
                "warn_at_fraction", f"must be between 0 and 1 (exclusive), got {self.warn_at_fraction}"
            )
        if self.budget_usd is not None and not self.tracking:
            raise ConfigError(
                "budget_usd",
                "needs a price to count against: set cost.instance (a catalog instance) or cost.price_usd_per_hour",
            )
        self._check_spot()

    def _check_spot(self) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        quote_settings = [n for n in _QUOTE_SETTINGS if getattr(self, n) != defaults[n]]
        for name in (*_SPOT_ONLY, *quote_settings):
            if getattr(self, name) is not None and self.pricing != "spot":
                raise ConfigError(
                    name, f"applies only with cost.pricing spot, but pricing is {self.pricing!r}"
                )
        if self.pricing == "spot" and self.instance is None:
            if any(getattr(self, n) is not None for n in _SPOT_ONLY):
                raise ConfigError(
                    "instance",
                    "the spot policy needs an instance (spot prices are quoted per type and region)",
                )
            if quote_settings:
                raise ConfigError(
                    "instance",
                    f"cost.{quote_settings[0]} applies to live spot quotes, which need an instance (spot prices are "
                    "quoted per type and region); without one the run is charged cost.price_usd_per_hour",
                )
        pause, scale = self.spot_pause_above_usd_per_hour, self.spot_scale_up_below_usd_per_hour
        if pause is not None and scale is not None and scale >= pause:
            raise ConfigError(
                "spot_scale_up_below_usd_per_hour",
                f"must be below spot_pause_above_usd_per_hour ({pause}), got {scale}",
            )

    @property
    def tracking(self) -> bool:
        """Whether live cost is tracked: a price is given or can be looked up for the instance."""
        return self.price_usd_per_hour is not None or self.instance is not None

    @property
    def instance_key(self) -> tuple[str, str, str] | None:
        """(provider, type, region) of `instance`, the catalog's key."""
        if self.instance is None:
            return None
        provider, type_, region = (p.strip() for p in self.instance.split("/"))
        return provider, type_, region
