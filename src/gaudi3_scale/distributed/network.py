"""Network-tuning presets for the collective libraries: NCCL (NVIDIA GPUs) and HCCL (Intel Gaudi).

A preset is a handful of environment variables, each with the documentation page that defines it. `launch()`
exports the chosen preset before the workers start (they inherit the environment), and only where a variable is
not set already: a user's own export always wins. Values are only ones that are valid on any cluster of the kind
the preset names; site-specific settings (which network interface, which adapter) are named in the description
for the user to set. See docs/network_presets.md for the table.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Literal

from gaudi3_scale.config.core import check_choice

__all__ = [
    "NETWORK_PRESETS",
    "NetworkPreset",
    "apply_network_preset",
    "get_network_preset",
    "register_network_preset",
]

log = logging.getLogger(__name__)

# NCCL's reference for every variable below; the fragment is the variable's own section on that page.
NCCL_ENV_DOCS = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
# Intel's pages for HCCL scale-out over host NICs and for Intel Gaudi software logs.
HCCL_HOST_NIC_DOCS = (
    "https://docs.habana.ai/en/latest/API_Reference_Guides/HCCL_APIs/Scale_Out_via_Host_NIC.html"
)
GAUDI_LOGS_DOCS = (
    "https://docs.habana.ai/en/latest/PyTorch/Reference/Debugging_Guide/Debugging_with_Intel_Gaudi_Logs.html"
)
UNVALIDATED = "Not yet validated on Gaudi hardware."


@dataclass(frozen=True, kw_only=True)
class NetworkPreset:
    name: str
    backend: Literal["nccl", "hccl"]
    description: str
    variables: dict[str, str]
    sources: dict[str, str]  # variable → the documentation page that defines it (every variable has one)


NETWORK_PRESETS: dict[str, NetworkPreset] = {}


def register_network_preset(preset: NetworkPreset) -> None:
    if preset.name in NETWORK_PRESETS:
        raise ValueError(f"network preset {preset.name!r} is already registered")
    unsourced = sorted(v for v in preset.variables if not preset.sources.get(v, "").startswith("https://"))
    if unsourced or set(preset.sources) != set(preset.variables):
        raise ValueError(
            f"network preset {preset.name!r}: sources must map each variable to an https page; "
            f"missing or not https: {unsourced}, extra: {sorted(set(preset.sources) - set(preset.variables))}"
        )
    NETWORK_PRESETS[preset.name] = preset


def get_network_preset(name: str) -> NetworkPreset:
    check_choice("parallel.network_preset", name, sorted(NETWORK_PRESETS))
    return NETWORK_PRESETS[name]


def apply_network_preset(name: str | None, env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Export preset `name` into `env` where a variable is unset; return what was set.

    None is the config default ("no preset") and sets nothing. A variable already in `env` is left alone, so
    calling this again in a worker that inherited the launcher's exports is harmless.
    """
    if name is None:
        return {}
    preset = get_network_preset(name)
    applied: dict[str, str] = {}
    for variable, value in preset.variables.items():
        if variable in env:
            log.debug("network preset %s: %s already set to %r; kept", name, variable, env[variable])
            continue
        env[variable] = applied[variable] = value
        log.info("network preset %s: %s=%s", name, variable, value)
    return applied


def _nccl(*variables: str) -> dict[str, str]:
    return {v: f"{NCCL_ENV_DOCS}#{v.lower().replace('_', '-')}" for v in variables}


register_network_preset(
    NetworkPreset(
        name="nccl-debug",
        backend="nccl",
        description=(
            "NCCL prints debug information for initialization, the environment variables it picked up, and the "
            "network (which interface and transport each connection uses). For diagnosing a run, not production."
        ),
        variables={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV,NET"},
        sources=_nccl("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS"),
    )
)
register_network_preset(
    NetworkPreset(
        name="nccl-ethernet",
        backend="nccl",
        description=(
            "Inter-node traffic over TCP/IP sockets on plain Ethernet (no InfiniBand/RoCE): NCCL_NET=Socket forces "
            "NCCL's socket transport instead of letting it choose. 4 helper threads x 4 sockets per connection, "
            "the values NCCL's docs give for generic 100G networks (their product must stay <= 64); more CPU use. "
            "Not for AWS EFA. Set NCCL_SOCKET_IFNAME yourself if NCCL picks the wrong interface."
        ),
        variables={"NCCL_NET": "Socket", "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"},
        sources=_nccl("NCCL_NET", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"),
    )
)
register_network_preset(
    NetworkPreset(
        name="nccl-infiniband",
        backend="nccl",
        description=(
            "Force NCCL's InfiniBand verbs transport (IB or RoCE) instead of letting NCCL choose, so a broken IB "
            "setup shows up at start-up rather than as a silent fall back to TCP sockets. Set NCCL_IB_HCA "
            "(adapters) and, on RoCE, NCCL_IB_GID_INDEX yourself if needed; GPUDirect RDMA (NCCL_NET_GDR_LEVEL) "
            "is left to NCCL's topology detection."
        ),
        variables={"NCCL_NET": "IB"},
        sources=_nccl("NCCL_NET"),
    )
)
register_network_preset(
    NetworkPreset(
        name="hccl-host-nic",
        backend="hccl",
        description=(
            f"{UNVALIDATED} Scale-out between servers through the host NICs with libfabric (efa, verbs or tcp "
            "provider) and host memory: setting HCCL_OVER_OFI turns off HCCL's auto-detection, which otherwise "
            "prefers the Gaudi scale-out NICs or Host NIC Gaudi Direct. For clusters whose Gaudi NICs are not "
            "wired for scale-out; needs libfabric and the HCCL OFI wrapper (preinstalled in Intel Gaudi "
            "containers). Set HCCL_SOCKET_IFNAME (and HCL_COMM_ID where Intel's page says so) yourself."
        ),
        variables={"HCCL_OVER_OFI": "1"},
        sources={"HCCL_OVER_OFI": HCCL_HOST_NIC_DOCS},
    )
)
register_network_preset(
    NetworkPreset(
        name="hccl-aws-efa",
        backend="hccl",
        description=(
            f"{UNVALIDATED} Host NIC Gaudi Direct over AWS EFA: the two variables Intel's scale-out page lists "
            "for it. Needs the EFA libfabric provider >= 1.16.1 and Linux >= 5.12. For HCCL only: AWS's NCCL "
            "plugin (aws-ofi-nccl) advises against RDMAV_FORK_SAFE, so do not reuse this preset for NCCL."
        ),
        variables={"RDMAV_FORK_SAFE": "1", "FI_EFA_USE_DEVICE_RDMA": "1"},
        sources={"RDMAV_FORK_SAFE": HCCL_HOST_NIC_DOCS, "FI_EFA_USE_DEVICE_RDMA": HCCL_HOST_NIC_DOCS},
    )
)
register_network_preset(
    NetworkPreset(
        name="hccl-debug",
        backend="hccl",
        description=(
            f"{UNVALIDATED} The most verbose log level (0) for every Intel Gaudi software component, HCCL "
            "included, as in Intel's log-collection steps. Logs go under $HABANA_LOGS (default ~/.habana_logs "
            "on bare metal, /var/log/habana_logs in a container); set ENABLE_CONSOLE=true yourself to print them "
            "instead. Very verbose: for diagnosing, not for training."
        ),
        variables={"LOG_LEVEL_ALL": "0"},
        sources={"LOG_LEVEL_ALL": GAUDI_LOGS_DOCS},
    )
)
