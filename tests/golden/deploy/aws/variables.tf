variable "region" {
  description = "AWS region"
  type        = string
  default     = "us-east-1"

  validation {
    condition     = can(regex("^[a-z]{2}(?:-[a-z]+)+-[0-9]+$", var.region))
    error_message = "region: an AWS region such as us-east-1 or us-gov-west-1"
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
  default     = "p5.48xlarge"
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

variable "ami_id" {
  description = "machine image of the nodes: one with the NVIDIA driver, Docker, the NVIDIA container toolkit, the EFA driver and the AWS CLI (an AWS Deep Learning Base GPU AMI has them)"
  type        = string
}

variable "subnet_id" {
  description = "subnet of the nodes (one availability zone) with outbound HTTPS through NAT or VPC endpoints; the nodes get no public address"
  type        = string
}

variable "ssh_key_name" {
  description = "EC2 key pair for SSH; null: none (use SSM Session Manager)"
  type        = string
  default     = null
}

variable "efa" {
  description = "give each node an EFA interface (the instance type must support EFA)"
  type        = bool
  default     = true
}

variable "root_volume_gb" {
  description = "root volume size (the image and local checkpoints live there)"
  type        = number
  default     = 500
}

variable "checkpoint_kms_key_arn" {
  description = "customer-managed KMS key for the checkpoint bucket; null: the AWS managed key aws/s3"
  type        = string
  default     = null
}

variable "data_buckets" {
  description = "S3 bucket -> the key prefixes under it the nodes may list and read (the run config's data and model URLs on s3://; \"\" = the whole bucket)"
  type        = map(list(string))
  default     = {}

  validation {
    condition     = alltrue([for b in keys(var.data_buckets) : can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", b))])
    error_message = "data_buckets: S3 bucket names (3-63 lower-case letters, digits, '.' and '-')"
  }
}
