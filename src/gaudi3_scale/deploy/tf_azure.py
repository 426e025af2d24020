"""Terraform for Azure: Linux VMs in a proximity placement group, a private, versioned checkpoint container that only
the nodes' managed identity can use, and a network security group that admits only the nodes themselves (and SSH
from one CIDR when asked). The nodes join an existing subnet (`subnet_id`) and get no public address.

The storage account has no public endpoint and takes no shared keys: the nodes reach it through a private endpoint
in their subnet (with a privatelink.blob.core.windows.net DNS zone linked to the subnet's virtual network) and
authenticate with their user-assigned identity (AZURE_CLIENT_ID); `checkpoint.remote_url` is
`az://checkpoints/<run>` (needs adlfs in the image).
"""

from __future__ import annotations

from gaudi3_scale.deploy.grammar import KEY_VAULT_NAME
from gaudi3_scale.deploy.instances import instance_for
from gaudi3_scale.deploy.quoting import hcl_string
from gaudi3_scale.deploy.spec import DeploySpec
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

__all__ = ["render_azure"]

# The vault's name (the id's last segment) goes into the node bootstrap's environment file: held to Key Vault's
# naming rule, so that no other text can.
_KEY_VAULT_ID = (
    f"var.key_vault_id == null || can(regex({hcl_string('/vaults/' + KEY_VAULT_NAME + '$')}, var.key_vault_id))",
    "key_vault_id: the resource id of a Key Vault (ending /vaults/<3-24 letters, digits, '-'>)",
)

VERSIONS = versions_tf(
    "azurerm",
    "hashicorp/azurerm",
    "~> 4.0",
    "4.x: storage containers by storage_account_id (management plane, no shared key needed)",
)

MAIN = """# gaudi3-scale training nodes on Azure, rendered by `gaudi3 deploy render --target azure`.

provider "azurerm" {
  features {}
  # the storage account allows no shared keys: data-plane calls use Entra ID
  storage_use_azuread = true
}

locals {
  tags           = { "gaudi3-scale-run" = var.name }
  key_vault_name = var.key_vault_id == null ? "" : element(split("/", var.key_vault_id), length(split("/", var.key_vault_id)) - 1)
  # 3-24 lower-case letters and digits, globally unique: the run name plus a hash of the resource group id
  storage_account = "${substr(replace(var.name, "-", ""), 0, 14)}${substr(sha1(azurerm_resource_group.main.id), 0, 10)}"
  checkpoint_url  = "az://${azurerm_storage_container.checkpoints.name}/${var.name}"
  vnet_id         = regex("^(.*)/subnets/[^/]+$", var.subnet_id)[0]
}

resource "azurerm_resource_group" "main" {
  name     = "${var.name}-rg"
  location = var.location
  tags     = local.tags
}

# ---- placement and network ---------------------------------------------------------------------------------------

resource "azurerm_proximity_placement_group" "nodes" {
  name                = "${var.name}-ppg"
  location            = azurerm_resource_group.main.location
  resource_group_name = azurerm_resource_group.main.name
  tags                = local.tags
}

resource "azurerm_application_security_group" "nodes" {
  name                = "${var.name}-nodes"
  location            = azurerm_resource_group.main.location
  resource_group_name = azurerm_resource_group.main.name
  tags                = local.tags
}

resource "azurerm_network_security_group" "nodes" {
  name                = "${var.name}-nodes"
  location            = azurerm_resource_group.main.location
  resource_group_name = azurerm_resource_group.main.name
  tags                = local.tags
}

# The c10d rendezvous (TCP 29500 on node 0) and NCCL's sockets, between the nodes only. (InfiniBand traffic does
# not pass through network security groups.)
resource "azurerm_network_security_rule" "between_nodes" {
  name                                       = "training-between-nodes"
  priority                                   = 100
  direction                                  = "Inbound"
  access                                     = "Allow"
  protocol                                   = "*"
  source_port_range                          = "*"
  destination_port_range                     = "*"
  source_application_security_group_ids      = [azurerm_application_security_group.nodes.id]
  destination_application_security_group_ids = [azurerm_application_security_group.nodes.id]
  description                                = "rendezvous and NCCL traffic between the training nodes"
  resource_group_name                        = azurerm_resource_group.main.name
  network_security_group_name                = azurerm_network_security_group.nodes.name
}

resource "azurerm_network_security_rule" "ssh" {
  count                       = var.ssh_allowed_cidr == null ? 0 : 1
  name                        = "ssh-from-operators"
  priority                    = 110
  direction                   = "Inbound"
  access                      = "Allow"
  protocol                    = "Tcp"
  source_port_range           = "*"
  destination_port_range      = "22"
  source_address_prefix       = var.ssh_allowed_cidr
  destination_address_prefix  = "*"
  description                 = "SSH from the operators' network"
  resource_group_name         = azurerm_resource_group.main.name
  network_security_group_name = azurerm_network_security_group.nodes.name
}

# Azure's default rules admit the whole virtual network (AllowVnetInBound); the nodes admit only each other.
resource "azurerm_network_security_rule" "deny_rest_of_vnet" {
  name                        = "deny-rest-of-vnet"
  priority                    = 4000
  direction                   = "Inbound"
  access                      = "Deny"
  protocol                    = "*"
  source_port_range           = "*"
  destination_port_range      = "*"
  source_address_prefix       = "VirtualNetwork"
  destination_address_prefix  = "*"
  description                 = "nothing else in the virtual network reaches the training nodes"
  resource_group_name         = azurerm_resource_group.main.name
  network_security_group_name = azurerm_network_security_group.nodes.name
}

# Created before the VMs so that every node's bootstrap knows node 0's address (the rendezvous master).
resource "azurerm_network_interface" "nodes" {
  count                          = var.nodes
  name                           = "${var.name}-node-${count.index}"
  location                       = azurerm_resource_group.main.location
  resource_group_name            = azurerm_resource_group.main.name
  accelerated_networking_enabled = true
  tags                           = local.tags

  ip_configuration {
    name                          = "primary"
    subnet_id                     = var.subnet_id
    private_ip_address_allocation = "Dynamic"
  }
}

resource "azurerm_network_interface_security_group_association" "nodes" {
  count                     = var.nodes
  network_interface_id      = azurerm_network_interface.nodes[count.index].id
  network_security_group_id = azurerm_network_security_group.nodes.id
}

resource "azurerm_network_interface_application_security_group_association" "nodes" {
  count                         = var.nodes
  network_interface_id          = azurerm_network_interface.nodes[count.index].id
  application_security_group_id = azurerm_application_security_group.nodes.id
}

# ---- checkpoint storage ------------------------------------------------------------------------------------------

resource "azurerm_storage_account" "checkpoints" {
  name                              = local.storage_account
  resource_group_name               = azurerm_resource_group.main.name
  location                          = azurerm_resource_group.main.location
  account_tier                      = "Standard"
  account_replication_type          = var.checkpoint_replication
  min_tls_version                   = "TLS1_2"
  https_traffic_only_enabled        = true
  allow_nested_items_to_be_public   = false
  shared_access_key_enabled         = false
  infrastructure_encryption_enabled = true
  public_network_access_enabled     = false
  tags                              = local.tags

  network_rules {
    default_action = "Deny"
    bypass         = ["AzureServices"]
  }

  blob_properties {
    versioning_enabled = true

    delete_retention_policy {
      days = 7
    }

    container_delete_retention_policy {
      days = 7
    }
  }
}

# The nodes reach the account through a private endpoint in their subnet (the account has no public endpoint).
resource "azurerm_private_dns_zone" "blob" {
  name                = "privatelink.blob.core.windows.net"
  resource_group_name = azurerm_resource_group.main.name
  tags                = local.tags
}

resource "azurerm_private_dns_zone_virtual_network_link" "blob" {
  name                  = "${var.name}-blob"
  resource_group_name   = azurerm_resource_group.main.name
  private_dns_zone_name = azurerm_private_dns_zone.blob.name
  virtual_network_id    = local.vnet_id
  tags                  = local.tags
}

resource "azurerm_private_endpoint" "checkpoints" {
  name                = "${var.name}-checkpoints"
  location            = azurerm_resource_group.main.location
  resource_group_name = azurerm_resource_group.main.name
  subnet_id           = var.subnet_id
  tags                = local.tags

  private_service_connection {
    name                           = "blob"
    private_connection_resource_id = azurerm_storage_account.checkpoints.id
    subresource_names              = ["blob"]
    is_manual_connection           = false
  }

  private_dns_zone_group {
    name                 = "blob"
    private_dns_zone_ids = [azurerm_private_dns_zone.blob.id]
  }
}

resource "azurerm_storage_container" "checkpoints" {
  name                  = "checkpoints"
  storage_account_id    = azurerm_storage_account.checkpoints.id
  container_access_type = "private"
}

resource "azurerm_storage_management_policy" "checkpoints" {
  storage_account_id = azurerm_storage_account.checkpoints.id

  rule {
    name    = "expire-old-versions"
    enabled = true

    filters {
      blob_types = ["blockBlob"]
    }

    actions {
      version {
        delete_after_days_since_creation = var.checkpoint_noncurrent_days
      }
    }
  }
}

# ---- node identity: this container, and the Key Vault secrets named in var.secrets, nothing else -----------------

resource "azurerm_user_assigned_identity" "nodes" {
  name                = "${var.name}-nodes"
  location            = azurerm_resource_group.main.location
  resource_group_name = azurerm_resource_group.main.name
  tags                = local.tags
}

resource "azurerm_role_assignment" "checkpoints" {
  scope                = "${azurerm_storage_account.checkpoints.id}/blobServices/default/containers/${azurerm_storage_container.checkpoints.name}"
  role_definition_name = "Storage Blob Data Contributor"
  principal_id         = azurerm_user_assigned_identity.nodes.principal_id
}

resource "azurerm_role_assignment" "secrets" {
  for_each             = var.key_vault_id == null ? {} : var.secrets
  scope                = "${var.key_vault_id}/secrets/${each.value}"
  role_definition_name = "Key Vault Secrets User"
  principal_id         = azurerm_user_assigned_identity.nodes.principal_id
}

# ---- nodes -------------------------------------------------------------------------------------------------------

resource "azurerm_linux_virtual_machine" "nodes" {
  count                           = var.nodes
  name                            = "${var.name}-node-${count.index}"
  location                        = azurerm_resource_group.main.location
  resource_group_name             = azurerm_resource_group.main.name
  size                            = var.instance_type
  proximity_placement_group_id    = azurerm_proximity_placement_group.nodes.id
  network_interface_ids           = [azurerm_network_interface.nodes[count.index].id]
  source_image_id                 = var.image_id
  admin_username                  = var.admin_username
  disable_password_authentication = true
  allow_extension_operations      = false
  encryption_at_host_enabled      = var.encryption_at_host
  tags                            = merge(local.tags, { "gaudi3-scale-node-rank" = tostring(count.index) })
  custom_data = base64encode(templatefile("${path.module}/bootstrap.sh.tftpl", {
    node_rank       = count.index
    rdzv_host       = azurerm_network_interface.nodes[0].private_ip_address
    nnodes          = var.nodes
    nproc_per_node  = var.nproc_per_node
    image           = var.image
    checkpoint_url  = local.checkpoint_url
    secrets         = var.secrets
    storage_account = azurerm_storage_account.checkpoints.name
    client_id       = azurerm_user_assigned_identity.nodes.client_id
    key_vault_name  = local.key_vault_name
  }))

  admin_ssh_key {
    username   = var.admin_username
    public_key = var.ssh_public_key
  }

  os_disk {
    caching              = "ReadWrite"
    storage_account_type = "Premium_LRS"
    disk_size_gb         = var.os_disk_gb
  }

  identity {
    type         = "UserAssigned"
    identity_ids = [azurerm_user_assigned_identity.nodes.id]
  }

  lifecycle {
    precondition {
      condition     = length(var.secrets) == 0 || var.key_vault_id != null
      error_message = "secrets names Key Vault secrets: set key_vault_id to the vault that holds them."
    }
  }
}
"""

OUTPUTS = outputs_tf(
    "azurerm_network_interface.nodes[*].private_ip_address",
    "; account: checkpoint_storage_account",
    extra='output "checkpoint_storage_account" {\n'
    '  description = "storage account of the checkpoint container"\n'
    "  value       = azurerm_storage_account.checkpoints.name\n"
    "}\n",
)

# A token for Key Vault from the instance metadata service, as the nodes' user-assigned identity.
_FETCH = """fetch() {
  local token
  token=$(curl -sSf -H Metadata:true \\
    "http://169.254.169.254/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fvault.azure.net&client_id=$AZURE_CLIENT_ID" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["access_token"])')
  curl -sSf -H "Authorization: Bearer $token" "https://$KEY_VAULT_NAME.vault.azure.net/secrets/$1?api-version=7.4" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["value"])'
}
"""


def render_azure(spec: DeploySpec) -> dict[str, str]:
    instance = instance_for("azure", spec.accelerator)
    location = default_region(spec, instance)
    variables = [
        region_variable("azure", "location", "Azure region (where your subscription has quota for instance_type)",
                        location),
        *common_variables(spec, instance.type),
        Variable("image_id", "string", "machine image of the nodes: one with the NVIDIA driver, InfiniBand drivers, "
                 "Docker and the NVIDIA container toolkit (e.g. an Azure HPC image)"),
        Variable("subnet_id", "string", "subnet of the nodes (with outbound internet access; the nodes get no "
                 "public address); the checkpoint storage's private endpoint goes there too"),
        Variable("admin_username", "string", "login user of the nodes", "azureuser"),
        Variable("ssh_public_key", "string", "OpenSSH public key of admin_username (password login is off)"),
        Variable("os_disk_gb", "number", "OS disk size (the image and local checkpoints live there)", 512),
        Variable("encryption_at_host", "bool", "encrypt temp disks and caches on the host (the subscription needs "
                 "the EncryptionAtHost feature)", True),
        Variable("checkpoint_replication", "string", "replication of the checkpoint storage account", "ZRS"),
        Variable("key_vault_id", "string", "Key Vault holding the secrets named in `secrets`; null: no secrets",
                 None, (_KEY_VAULT_ID,)),
    ]  # fmt: skip
    bootstrap = render_bootstrap(
        spec,
        fetch_secrets=secrets_fetcher("Azure Key Vault", _FETCH),
        pass_env={
            "AZURE_STORAGE_ACCOUNT_NAME": "${storage_account}",
            "AZURE_CLIENT_ID": "${client_id}",
            "KEY_VAULT_NAME": "${key_vault_name}",
        },
    )
    return tf_files(versions=VERSIONS, variables=variables, main=MAIN, outputs=OUTPUTS, bootstrap=bootstrap)
