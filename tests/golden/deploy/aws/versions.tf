terraform {
  required_version = ">= 1.5"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 6.10 added aws_instance.primary_network_interface (the EFA interface below)
      version = "~> 6.10"
    }
  }
}
