# gaudi3-scale training nodes on Google Cloud, rendered by `gaudi3 deploy render --target gcp`.

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
