# gaudi3-scale training nodes on Azure, rendered by `gaudi3 deploy render --target azure`.

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
