output "node_private_ips" {
  description = "private address of each node, by node_rank"
  value       = azurerm_network_interface.nodes[*].private_ip_address
}

output "master_address" {
  description = "the c10d rendezvous endpoint (node 0)"
  value       = "${azurerm_network_interface.nodes[0].private_ip_address}:29500"
}

output "checkpoint_url" {
  description = "where the nodes mirror their checkpoints (checkpoint.remote_url; account: checkpoint_storage_account)"
  value       = local.checkpoint_url
}

output "checkpoint_storage_account" {
  description = "storage account of the checkpoint container"
  value       = azurerm_storage_account.checkpoints.name
}
