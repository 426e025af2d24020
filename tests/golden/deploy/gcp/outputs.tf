output "node_private_ips" {
  description = "private address of each node, by node_rank"
  value       = google_compute_address.nodes[*].address
}

output "master_address" {
  description = "the c10d rendezvous endpoint (node 0)"
  value       = "${google_compute_address.nodes[0].address}:29500"
}

output "checkpoint_url" {
  description = "where the nodes mirror their checkpoints (checkpoint.remote_url)"
  value       = local.checkpoint_url
}
