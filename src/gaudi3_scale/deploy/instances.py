"""Which catalog instance a cloud target rents for an accelerator.

A module of its own below `spec` (the default accelerators per node of a cloud deployment) and `tf_common` (the
instance type the Terraform renders): both import it, and it imports neither.
"""

from __future__ import annotations

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.metering.catalog import Instance, load_instances

__all__ = ["ACCELERATORS", "instance_for"]

# Accelerators a deployment can ask for (names of device/accelerators.yaml entries, by their short alias).
ACCELERATORS = {
    "gaudi3": "gaudi3",
    "gaudi2": "gaudi2",
    "h100": "h100-sxm",
    "h200": "h200-sxm",
    "a100": "a100-sxm",
}


def instance_for(target: str, accelerator: str) -> Instance:
    """The catalog instance `target` rents for `accelerator` (most accelerators per node first); none is one line
    naming what the catalog does have."""
    wanted = ACCELERATORS.get(accelerator, accelerator)
    catalog = sorted(load_instances().values(), key=lambda i: (i.provider, -i.accelerators_per_node, i.type))
    offered = [i for i in catalog if i.provider == target and i.accelerator == wanted]
    if offered:
        return offered[0]
    own = [f"{i.type} ({i.accelerators_per_node} × {i.accelerator})" for i in catalog if i.provider == target]
    elsewhere = sorted({f"{i.provider} {i.type}" for i in catalog if i.accelerator == wanted})
    where = (
        f"{accelerator} is offered by {', '.join(elsewhere)}"
        if elsewhere
        else f"no cloud in the catalog offers {accelerator}: use --target onprem or k8s"
    )
    raise UserInputError(
        f"--target {target} --accelerator {accelerator}: {target} offers no {wanted} instance in the catalog; "
        f"{target} instances that exist: {', '.join(own) or 'none'}; {where}"
    )
