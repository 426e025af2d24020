"""`gaudi3 deploy render --target aws|azure|gcp`: Terraform for a multi-node training cluster.

Per cloud (`tf_aws`, `tf_azure`, `tf_gcp`): the catalog's instance type for the accelerator, nodes packed close
together (a cluster placement group / proximity placement group / compact placement policy), firewall rules that
open only the traffic between the nodes (and SSH from one CIDR when asked), a versioned, encrypted, private
checkpoint bucket that only the nodes' identity can use, and a per-node bootstrap that starts `gaudi3 train` with
the node's rank (see `deploy/bootstrap.py`). A cloud without the accelerator is one line naming what it has.
"""

from __future__ import annotations

from gaudi3_scale.deploy.instances import instance_for
from gaudi3_scale.deploy.render import register_renderer
from gaudi3_scale.deploy.tf_aws import render_aws
from gaudi3_scale.deploy.tf_azure import render_azure
from gaudi3_scale.deploy.tf_gcp import render_gcp

__all__ = ["instance_for", "render_aws", "render_azure", "render_gcp"]

register_renderer("aws", render_aws)
register_renderer("azure", render_azure)
register_renderer("gcp", render_gcp)
