variable "project" {
  description = "Google Cloud project id"
  type        = string

  validation {
    condition     = can(regex("^(?:[a-z][-a-z0-9.]*[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$", var.project))
    error_message = "project: a Google Cloud project id such as my-project"
  }
}

variable "zone" {
  description = "zone of the nodes (where the project has quota for instance_type)"
  type        = string

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.zone))
    error_message = "zone: gcp needs a zone such as us-central1-a (a compact placement policy is per zone)"
  }
}

variable "name" {
  description = "prefix of every resource name (the run name)"
  type        = string
  default     = "golden"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$", var.name))
    error_message = "name: 1-40 lower-case letters, digits and '-', not starting or ending with '-'"
  }
}

variable "nodes" {
  description = "machines to train on; node 0 is the rendezvous master (the render checked the run config on its default: re-render with another value rather than -var)"
  type        = number
  default     = 2

  validation {
    condition     = var.nodes >= 1 && floor(var.nodes) == var.nodes
    error_message = "nodes must be a whole number of at least 1"
  }
}

variable "nproc_per_node" {
  description = "training processes per node (one per accelerator) (the render checked the run config on its default: re-render with another value rather than -var)"
  type        = number
  default     = 8

  validation {
    condition     = var.nproc_per_node >= 1 && floor(var.nproc_per_node) == var.nproc_per_node
    error_message = "nproc_per_node must be a whole number of at least 1"
  }
}

variable "instance_type" {
  description = "machine type (from the gaudi3-scale instance catalog)"
  type        = string
  default     = "a3-highgpu-8g"
}

variable "image" {
  description = "training container image every node runs (must be pullable from the nodes)"
  type        = string
  default     = "registry.example.com/gaudi3-scale-train:golden-cuda"

  validation {
    condition     = can(regex("^(?:(?:(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*|\\[(?:[a-fA-F0-9:]+)\\])(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$", var.image))
    error_message = "image: an OCI image reference such as registry.example.com/team/train:1.0"
  }
}

variable "ssh_allowed_cidr" {
  description = "CIDR allowed to reach the nodes on port 22; null: no SSH rule"
  type        = string
  default     = null
}

variable "secrets" {
  description = "environment variable name -> the secret store's name for the value (read by each node at start; values never appear in Terraform files or state)"
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.secrets) : can(regex("^[A-Za-z_][A-Za-z0-9_]*$", k))])
    error_message = "secrets: keys must be environment variable names"
  }

  validation {
    condition     = alltrue([for v in values(var.secrets) : can(regex("^[A-Za-z0-9/_.-]{1,512}$", v))])
    error_message = "secrets: values must be secret names (letters, digits, '/', '_', '.', '-')"
  }
}

variable "checkpoint_noncurrent_days" {
  description = "days an overwritten or deleted checkpoint object version is kept"
  type        = number
  default     = 30
}

variable "image_id" {
  description = "boot image of the nodes: one with the NVIDIA driver, Docker and the NVIDIA container toolkit"
  type        = string
}

variable "subnetwork" {
  description = "name of the nodes' subnetwork in the zone's region (outbound access through Cloud NAT; the nodes get no public address)"
  type        = string
}

variable "boot_disk_gb" {
  description = "boot disk size (the image and local checkpoints live there)"
  type        = number
  default     = 500
}

variable "boot_disk_type" {
  description = "boot disk type"
  type        = string
  default     = "pd-ssd"
}

variable "secure_boot" {
  description = "Shielded VM secure boot (needs signed NVIDIA kernel modules in the image)"
  type        = bool
  default     = false
}

variable "checkpoint_kms_key" {
  description = "Cloud KMS key for the checkpoint bucket; null: Google-managed encryption"
  type        = string
  default     = null
}
