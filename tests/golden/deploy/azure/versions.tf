terraform {
  required_version = ">= 1.5"

  required_providers {
    azurerm = {
      source = "hashicorp/azurerm"
      # 4.x: storage containers by storage_account_id (management plane, no shared key needed)
      version = "~> 4.0"
    }
  }
}
