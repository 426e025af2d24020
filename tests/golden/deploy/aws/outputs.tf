output "node_private_ips" {
  description = "private address of each node, by node_rank"
  value       = aws_network_interface.nodes[*].private_ip
}

output "master_address" {
  description = "the c10d rendezvous endpoint (node 0)"
  value       = "${aws_network_interface.nodes[0].private_ip}:29500"
}

output "checkpoint_url" {
  description = "where the nodes mirror their checkpoints (checkpoint.remote_url)"
  value       = local.checkpoint_url
}

output "instance_ids" {
  description = "EC2 instance id of each node, by node_rank"
  value       = aws_instance.nodes[*].id
}
