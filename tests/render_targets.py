"""`gaudi3 deploy render`'s flags besides --target and what it renders from, per target, for the deploy CLI tests:
aws, azure and gcp an accelerator a cloud offers; onprem one host (its hosts keep --out on their own disks, so a
config over several needs checkpoint.remote_url: `ONPREM_NODES` adds a second); ci one node (its repro tier's
ranks)."""

from __future__ import annotations

__all__ = ["ONPREM_NODES", "TARGET_FLAGS"]

TARGET_FLAGS: dict[str, list[str]] = {
    "aws": ["--accelerator", "h100", "--nodes", "2"],
    "azure": ["--accelerator", "h100", "--nodes", "2"],
    "gcp": ["--accelerator", "h100", "--nodes", "2"],
    "onprem": ["--accelerator", "gaudi3", "--nodes", "1", "--hosts", "a"],
    "k8s": ["--accelerator", "h100", "--nodes", "2"],
    "ci": ["--accelerator", "h100", "--nodes", "1"],
}
ONPREM_NODES = [
    "--nodes",
    "2",
    "--hosts",
    "a,b",
]  # after TARGET_FLAGS["onprem"]: two hosts (the last flag wins)
