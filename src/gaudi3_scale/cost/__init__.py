"""Cost and capacity planning: the instance price catalog (and, as it grows, cost estimates and live cost)."""
