"""Terraform for Google Cloud: Compute Engine nodes under one compact placement policy, a private, versioned
checkpoint bucket that only the nodes' service account can use, and firewall rules that admit only the nodes
themselves (and SSH from one CIDR when asked). The nodes join an existing subnetwork and get no public address
(outbound access through Cloud NAT). The bootstrap runs as the instances' `startup-script` (every boot; it is
idempotent), which works on images with and without cloud-init.

Only the first network interface is configured: the GPUDirect NICs of A3 machines are not set up here.
"""

from __future__ import annotations

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.deploy.grammar import GCP_PROJECT
from gaudi3_scale.deploy.instances import instance_for
from gaudi3_scale.deploy.spec import DeploySpec
from gaudi3_scale.deploy.tf_common import (
    REQUIRED,
    Variable,
    common_variables,
    default_region,
    outputs_tf,
    regex_validation,
    region_variable,
    render_bootstrap,
    secrets_fetcher,
    tf_files,
    versions_tf,
)

__all__ = ["render_gcp"]

VERSIONS = versions_tf("google", "hashicorp/google", "~> 6.0")

MAIN = """# gaudi3-scale training nodes on Google Cloud, rendered by `gaudi3 deploy render --target gcp`.

provider "google" {
  project = var.project
  region  = local.region
  zone    = var.zone
}

locals {
  region = join("-", slice(split("-", var.zone), 0, 2))
  labels = { "gaudi3-scale-run" = var.name }
  # service account ids: 6-30 characters, no trailing '-'; the name's first 17 characters and 8 hex digits of its
  # hash (29), so that two run names that share their start do not collide in one project
  account_id     = "g3-${replace(substr(var.name, 0, 17), "/-+$/", "")}-${substr(sha1(var.name), 0, 8)}"
  checkpoint_url = "gs://${google_storage_bucket.checkpoints.name}/${var.name}"
}

data "google_compute_subnetwork" "nodes" {
  name   = var.subnetwork
  region = local.region
}

resource "google_service_account" "nodes" {
  account_id   = local.account_id
  display_name = "gaudi3-scale training nodes of ${var.name}"
}

# ---- placement and network ---------------------------------------------------------------------------------------

resource "google_compute_resource_policy" "placement" {
  name   = "${var.name}-compact"
  region = local.region

  group_placement_policy {
    collocation = "COLLOCATED"
  }
}

# The c10d rendezvous (TCP 29500 on node 0) and NCCL's sockets, between the nodes only (matched by their service
# account, which only these instances run as).
resource "google_compute_firewall" "between_nodes" {
  name                    = "${var.name}-between-nodes"
  network                 = data.google_compute_subnetwork.nodes.network
  direction               = "INGRESS"
  description             = "rendezvous and NCCL traffic between the training nodes"
  source_service_accounts = [google_service_account.nodes.email]
  target_service_accounts = [google_service_account.nodes.email]

  allow {
    protocol = "tcp"
  }

  allow {
    protocol = "udp"
  }

  allow {
    protocol = "icmp"
  }
}

resource "google_compute_firewall" "ssh" {
  count                   = var.ssh_allowed_cidr == null ? 0 : 1
  name                    = "${var.name}-ssh"
  network                 = data.google_compute_subnetwork.nodes.network
  direction               = "INGRESS"
  description             = "SSH from the operators' network"
  source_ranges           = [var.ssh_allowed_cidr]
  target_service_accounts = [google_service_account.nodes.email]

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }
}

# Reserved before the instances so that every node's bootstrap knows node 0's address (the rendezvous master).
resource "google_compute_address" "nodes" {
  count        = var.nodes
  name         = "${var.name}-node-${count.index}"
  region       = local.region
  subnetwork   = data.google_compute_subnetwork.nodes.self_link
  address_type = "INTERNAL"
}

# ---- checkpoint bucket -------------------------------------------------------------------------------------------

resource "google_storage_bucket" "checkpoints" {
  name                        = "${var.name}-ckpt-${substr(sha1(var.project), 0, 8)}"
  location                    = upper(local.region)
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  labels                      = local.labels

  versioning {
    enabled = true
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.checkpoint_noncurrent_days
    }
    action {
      type = "Delete"
    }
  }

  dynamic "encryption" {
    for_each = var.checkpoint_kms_key == null ? [] : [1]

    content {
      default_kms_key_name = var.checkpoint_kms_key
    }
  }
}

# ---- node identity: this bucket, and the Secret Manager secrets named in var.secrets, nothing else ---------------

resource "google_storage_bucket_iam_member" "checkpoints" {
  bucket = google_storage_bucket.checkpoints.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.nodes.email}"
}

resource "google_secret_manager_secret_iam_member" "secrets" {
  for_each  = var.secrets
  project   = var.project
  secret_id = each.value
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.nodes.email}"
}

# ---- nodes -------------------------------------------------------------------------------------------------------

resource "google_compute_instance" "nodes" {
  count             = var.nodes
  name              = "${var.name}-node-${count.index}"
  machine_type      = var.instance_type
  zone              = var.zone
  resource_policies = [google_compute_resource_policy.placement.id]
  labels            = merge(local.labels, { "gaudi3-scale-node-rank" = tostring(count.index) })

  boot_disk {
    initialize_params {
      image = var.image_id
      size  = var.boot_disk_gb
      type  = var.boot_disk_type
    }
  }

  network_interface {
    subnetwork = data.google_compute_subnetwork.nodes.self_link
    network_ip = google_compute_address.nodes[count.index].address
  }

  # Instances with GPUs cannot live-migrate.
  scheduling {
    on_host_maintenance = "TERMINATE"
    automatic_restart   = true
  }

  service_account {
    email  = google_service_account.nodes.email
    scopes = ["cloud-platform"]
  }

  shielded_instance_config {
    enable_secure_boot          = var.secure_boot
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    enable-oslogin         = "TRUE"
    block-project-ssh-keys = "TRUE"
    serial-port-enable     = "FALSE"
    startup-script = templatefile("${path.module}/bootstrap.sh.tftpl", {
      node_rank      = count.index
      rdzv_host      = google_compute_address.nodes[0].address
      nnodes         = var.nodes
      nproc_per_node = var.nproc_per_node
      image          = var.image
      checkpoint_url = local.checkpoint_url
      secrets        = var.secrets
      project        = var.project
    })
  }
}
"""

OUTPUTS = outputs_tf("google_compute_address.nodes[*].address")

# An access token for the instance's service account from the metadata server; Secret Manager's REST API.
_FETCH = """fetch() {
  local token
  token=$(curl -sSf -H 'Metadata-Flavor: Google' \\
    http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["access_token"])')
  curl -sSf -H "Authorization: Bearer $token" \\
    "https://secretmanager.googleapis.com/v1/projects/$GOOGLE_CLOUD_PROJECT/secrets/$1/versions/latest:access" |
    python3 -c 'import base64, json, sys; print(base64.b64decode(json.load(sys.stdin)["payload"]["data"]).decode())'
}
"""


def render_gcp(spec: DeploySpec) -> dict[str, str]:
    instance = instance_for("gcp", spec.accelerator)
    if not spec.name[0].isalpha():
        raise UserInputError(
            f"the run name {spec.name!r} cannot name Google Cloud resources: it must start with a letter "
            "(set `name:` in the config or --name)"
        )
    zone = default_region(spec, instance)  # --region is a zone here (deploy/grammar.py REGIONS["gcp"])
    # A3 Ultra machines boot from Hyperdisk only; the others take a persistent disk.
    disk_type = "hyperdisk-balanced" if instance.type.startswith("a3-ultragpu") else "pd-ssd"
    variables = [
        Variable("project", "string", "Google Cloud project id", REQUIRED,
                 (regex_validation("project", GCP_PROJECT, "project: a Google Cloud project id such as my-project"),)),
        region_variable("gcp", "zone", "zone of the nodes (where the project has quota for instance_type)", zone),
        *common_variables(spec, instance.type),
        Variable("image_id", "string", "boot image of the nodes: one with the NVIDIA driver, Docker and the NVIDIA "
                 "container toolkit"),
        Variable("subnetwork", "string", "name of the nodes' subnetwork in the zone's region (outbound access "
                 "through Cloud NAT; the nodes get no public address)"),
        Variable("boot_disk_gb", "number", "boot disk size (the image and local checkpoints live there)", 500),
        Variable("boot_disk_type", "string", "boot disk type", disk_type),
        Variable("secure_boot", "bool", "Shielded VM secure boot (needs signed NVIDIA kernel modules in the image)",
                 False),
        Variable("checkpoint_kms_key", "string",
                 "Cloud KMS key for the checkpoint bucket; null: Google-managed encryption", None),
    ]  # fmt: skip
    bootstrap = render_bootstrap(
        spec,
        fetch_secrets=secrets_fetcher("Google Secret Manager", _FETCH),
        pass_env={"GOOGLE_CLOUD_PROJECT": "${project}"},
    )
    return tf_files(versions=VERSIONS, variables=variables, main=MAIN, outputs=OUTPUTS, bootstrap=bootstrap)
