"""Deployment files generated from one training config: Terraform (aws, azure, gcp), Ansible (onprem), Kubernetes
(PyTorchJob or indexed Jobs), container images and a Metaflow flow. Nothing here talks to a cloud: files are
rendered, validated offline, and handed to terraform / kubectl only when asked (`gaudi3 deploy plan|apply`)."""
