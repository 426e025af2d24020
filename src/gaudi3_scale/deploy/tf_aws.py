"""Terraform for AWS: EC2 nodes in a cluster placement group with EFA, an S3 checkpoint bucket, a least-privilege
instance role. The nodes join an existing subnet (`subnet_id`, one availability zone: a cluster placement group and
EFA both need that) and get no public address; they reach the internet (image registry, S3, SSM) through the
subnet's NAT or VPC endpoints.

EFA: one EFA interface (EFA with ENA) per node, on network card 0. A p5.48xlarge has more network cards; AWS's EFA
guide ("Maximize network bandwidth on Amazon EC2 instances with multiple network cards") describes adding an
EFA-only interface per card for full bandwidth, which this file does not do yet.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.deploy.instances import instance_for
from gaudi3_scale.deploy.spec import DeploySpec, storage_urls, url_bucket
from gaudi3_scale.deploy.tf_common import (
    Variable,
    common_variables,
    default_region,
    outputs_tf,
    region_variable,
    render_bootstrap,
    secrets_fetcher,
    tf_files,
    versions_tf,
)

__all__ = ["render_aws"]

# Instance families with EFA (AWS EFA user guide, "Supported instance types").
_EFA_PREFIXES = ("p4d.", "p4de.", "p5.48xlarge", "p5e.", "p5en.")
_USER_DATA_BYTES = 16 * 1024

VERSIONS = versions_tf(
    "aws",
    "hashicorp/aws",
    "~> 6.10",
    "6.10 added aws_instance.primary_network_interface (the EFA interface below)",
)

MAIN = """# gaudi3-scale training nodes on AWS, rendered by `gaudi3 deploy render --target aws`.

provider "aws" {
  region = var.region

  default_tags {
    tags = {
      "gaudi3-scale/run" = var.name
    }
  }
}

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_subnet" "nodes" {
  id = var.subnet_id
}

locals {
  checkpoint_url = "s3://${aws_s3_bucket.checkpoints.id}/${var.name}"
  account_id     = data.aws_caller_identity.current.account_id
  partition      = data.aws_partition.current.partition
}

# ---- placement and network ---------------------------------------------------------------------------------------

resource "aws_placement_group" "nodes" {
  name     = "${var.name}-nodes"
  strategy = "cluster"
}

resource "aws_security_group" "nodes" {
  name        = "${var.name}-nodes"
  description = "gaudi3-scale training nodes: all traffic among themselves, HTTPS out, SSH only from ssh_allowed_cidr"
  vpc_id      = data.aws_subnet.nodes.vpc_id
}

# EFA needs all traffic allowed to and from the security group itself (AWS EFA user guide). The same rule carries
# the c10d rendezvous (TCP 29500 on node 0) and NCCL's bootstrap sockets; nothing else reaches the nodes.
resource "aws_vpc_security_group_ingress_rule" "between_nodes" {
  security_group_id            = aws_security_group.nodes.id
  referenced_security_group_id = aws_security_group.nodes.id
  ip_protocol                  = "-1"
  description                  = "rendezvous, NCCL and EFA traffic between the training nodes"
}

resource "aws_vpc_security_group_egress_rule" "between_nodes" {
  security_group_id            = aws_security_group.nodes.id
  referenced_security_group_id = aws_security_group.nodes.id
  ip_protocol                  = "-1"
  description                  = "rendezvous, NCCL and EFA traffic between the training nodes"
}

resource "aws_vpc_security_group_egress_rule" "https" {
  security_group_id = aws_security_group.nodes.id
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  description       = "container registry, S3 and SSM over HTTPS"
}

resource "aws_vpc_security_group_ingress_rule" "ssh" {
  count             = var.ssh_allowed_cidr == null ? 0 : 1
  security_group_id = aws_security_group.nodes.id
  cidr_ipv4         = var.ssh_allowed_cidr
  ip_protocol       = "tcp"
  from_port         = 22
  to_port           = 22
  description       = "SSH from the operators' network"
}

# Created before the instances so that every node's bootstrap knows node 0's address (the rendezvous master).
resource "aws_network_interface" "nodes" {
  count           = var.nodes
  subnet_id       = var.subnet_id
  security_groups = [aws_security_group.nodes.id]
  interface_type  = var.efa ? "efa" : null
  description     = "${var.name} node ${count.index}"
}

# ---- checkpoint bucket -------------------------------------------------------------------------------------------

resource "aws_s3_bucket" "checkpoints" {
  bucket_prefix = "${substr(var.name, 0, 30)}-ckpt-"
}

resource "aws_s3_bucket_public_access_block" "checkpoints" {
  bucket                  = aws_s3_bucket.checkpoints.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_versioning" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = var.checkpoint_kms_key_arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id

  rule {
    id     = "expire-old-versions"
    status = "Enabled"

    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.checkpoint_noncurrent_days
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }
}

data "aws_iam_policy_document" "checkpoints_bucket" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.checkpoints.arn, "${aws_s3_bucket.checkpoints.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  policy = data.aws_iam_policy_document.checkpoints_bucket.json
}

# ---- instance role: this bucket, and the SSM parameters named in var.secrets, nothing else --------------------------

data "aws_iam_policy_document" "assume_ec2" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "nodes" {
  statement {
    sid       = "ListCheckpoints"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [aws_s3_bucket.checkpoints.arn]
  }

  statement {
    sid       = "ReadWriteCheckpoints"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = ["${aws_s3_bucket.checkpoints.arn}/*"]
  }

  dynamic "statement" {
    for_each = length(var.data_buckets) == 0 ? [] : [1]

    content {
      sid       = "LocateData"
      actions   = ["s3:GetBucketLocation"]
      resources = [for b in keys(var.data_buckets) : "arn:${local.partition}:s3:::${b}"]
    }
  }

  # Only the keys under each URL's prefix: listing is held to them by s3:prefix, reading by the object ARN.
  dynamic "statement" {
    for_each = var.data_buckets

    content {
      actions   = ["s3:ListBucket"]
      resources = ["arn:${local.partition}:s3:::${statement.key}"]

      condition {
        test     = "StringLike"
        variable = "s3:prefix"
        values   = [for p in statement.value : "${p}*"]
      }
    }
  }

  dynamic "statement" {
    for_each = length(var.data_buckets) == 0 ? [] : [1]

    content {
      sid       = "ReadData"
      actions   = ["s3:GetObject"]
      resources = flatten([for b, prefixes in var.data_buckets : [for p in prefixes : "arn:${local.partition}:s3:::${b}/${p}*"]])
    }
  }

  dynamic "statement" {
    for_each = length(var.secrets) == 0 ? [] : [1]

    content {
      sid       = "ReadNamedSecrets"
      actions   = ["ssm:GetParameter"]
      resources = [for p in values(var.secrets) : "arn:${local.partition}:ssm:${var.region}:${local.account_id}:parameter/${trimprefix(p, "/")}"]
    }
  }

  dynamic "statement" {
    for_each = var.checkpoint_kms_key_arn == null ? [] : [1]

    content {
      sid       = "UseCheckpointKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [var.checkpoint_kms_key_arn]
    }
  }
}

resource "aws_iam_role" "nodes" {
  name_prefix        = "${substr(var.name, 0, 30)}-nodes-"
  assume_role_policy = data.aws_iam_policy_document.assume_ec2.json
}

resource "aws_iam_role_policy" "nodes" {
  name   = "checkpoints-and-secrets"
  role   = aws_iam_role.nodes.id
  policy = data.aws_iam_policy_document.nodes.json
}

resource "aws_iam_instance_profile" "nodes" {
  name_prefix = "${substr(var.name, 0, 30)}-nodes-"
  role        = aws_iam_role.nodes.name
}

# ---- nodes -------------------------------------------------------------------------------------------------------

resource "aws_instance" "nodes" {
  count                       = var.nodes
  ami                         = var.ami_id
  instance_type               = var.instance_type
  placement_group             = aws_placement_group.nodes.id
  key_name                    = var.ssh_key_name
  iam_instance_profile        = aws_iam_instance_profile.nodes.name
  ebs_optimized               = true
  monitoring                  = true
  user_data_replace_on_change = true
  user_data = templatefile("${path.module}/bootstrap.sh.tftpl", {
    node_rank      = count.index
    rdzv_host      = aws_network_interface.nodes[0].private_ip
    nnodes         = var.nodes
    nproc_per_node = var.nproc_per_node
    image          = var.image
    checkpoint_url = local.checkpoint_url
    secrets        = var.secrets
    region         = var.region
  })

  primary_network_interface {
    network_interface_id = aws_network_interface.nodes[count.index].id
  }

  # IMDSv2 only; one hop is enough because the training container shares the host's network.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  root_block_device {
    encrypted   = true
    volume_type = "gp3"
    volume_size = var.root_volume_gb
  }

  tags = {
    Name                     = "${var.name}-node-${count.index}"
    "gaudi3-scale/node-rank" = tostring(count.index)
  }
}
"""

OUTPUTS = outputs_tf(
    "aws_network_interface.nodes[*].private_ip",
    extra='output "instance_ids" {\n'
    '  description = "EC2 instance id of each node, by node_rank"\n'
    "  value       = aws_instance.nodes[*].id\n"
    "}\n",
)

# The AWS CLI ships on AWS's Deep Learning AMIs (the images `ami_id` is meant for).
_FETCH = """fetch() {
  aws ssm get-parameter --region "$AWS_DEFAULT_REGION" --with-decryption --name "$1" \\
    --query Parameter.Value --output text
}
"""


def data_buckets(spec: DeploySpec) -> dict[str, list[str]]:
    """The S3 buckets of the run config's data and model URLs, each with the key prefixes those URLs name
    (`s3://b/team-a/corpus` -> {"b": ["team-a/corpus"]}; the whole bucket: [""]): the instance role may list and
    read the keys under them, no others. The config's own checkpoint.remote_url is not among them: every node
    mirrors to the bucket this Terraform creates instead. A prepared dataset or shard cache written to S3 at run
    time would need write access too, which is not granted."""
    buckets: dict[str, list[str]] = {}
    for name, url in storage_urls(spec.run_config):
        if name != "checkpoint.remote_url" and url.lower().startswith(("s3://", "s3a://")):
            buckets.setdefault(url_bucket(url), []).append(urlsplit(url).path.lstrip("/"))
    return {bucket: sorted(set(prefixes)) for bucket, prefixes in sorted(buckets.items())}


def render_aws(spec: DeploySpec) -> dict[str, str]:
    instance = instance_for("aws", spec.accelerator)
    region = default_region(spec, instance)
    efa = instance.type.startswith(_EFA_PREFIXES)
    variables = [
        region_variable("aws", "region", "AWS region", region),
        *common_variables(spec, instance.type),
        Variable("ami_id", "string", "machine image of the nodes: one with the NVIDIA driver, Docker, the NVIDIA "
                 "container toolkit, the EFA driver and the AWS CLI (an AWS Deep Learning Base GPU AMI has them)"),
        Variable("subnet_id", "string", "subnet of the nodes (one availability zone) with outbound HTTPS through "
                 "NAT or VPC endpoints; the nodes get no public address"),
        Variable("ssh_key_name", "string", "EC2 key pair for SSH; null: none (use SSM Session Manager)", None),
        Variable("efa", "bool", "give each node an EFA interface (the instance type must support EFA)", efa),
        Variable("root_volume_gb", "number", "root volume size (the image and local checkpoints live there)", 500),
        Variable("checkpoint_kms_key_arn", "string",
                 "customer-managed KMS key for the checkpoint bucket; null: the AWS managed key aws/s3", None),
        Variable("data_buckets", "map(list(string))", "S3 bucket -> the key prefixes under it the nodes may list "
                 "and read (the run config's data and model URLs on s3://; \"\" = the whole bucket)",
                 data_buckets(spec),
                 (("alltrue([for b in keys(var.data_buckets) : can(regex(\"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$\", b))])",
                   "data_buckets: S3 bucket names (3-63 lower-case letters, digits, '.' and '-')"),)),
    ]  # fmt: skip
    bootstrap = render_bootstrap(
        spec,
        fetch_secrets=secrets_fetcher("AWS SSM Parameter Store", _FETCH),
        pass_env={"AWS_DEFAULT_REGION": "${region}"},
    )
    # EC2 takes at most 16 KB of user data in raw form (EC2 user guide, "Run commands at launch"); the per-node
    # values Terraform fills in add well under 1 KB.
    if len(bootstrap.encode()) > _USER_DATA_BYTES - 1024:
        raise UserInputError(
            f"{spec.config_path}: the node bootstrap would be {len(bootstrap.encode()):,} bytes with this run config; "
            f"EC2 user data holds {_USER_DATA_BYTES:,}: shorten the config (drop fields left at their defaults)"
        )
    return tf_files(versions=VERSIONS, variables=variables, main=MAIN, outputs=OUTPUTS, bootstrap=bootstrap)
