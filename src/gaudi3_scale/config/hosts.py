"""Host names, IP addresses and HOST:PORT endpoints a user types: one grammar for the rendezvous and deploy hosts.

A host is a name of RFC 1123 labels (letters, digits and '-', dot-separated, any case, at most 253 characters) or
an IP address without a zone id (fe80::1%eth0 names an interface of one machine). An endpoint is HOST:PORT with a
port from 1 to 65535; its host is not all digits and dots unless it is an IPv4 address (RFC 1123 2.1: a host name
never has that form, so 10.0.0.256 is a mistyped address), and an IPv6 address goes in brackets ([fd00::1]:29500,
RFC 3986's authority form: without them the last ':' is ambiguous). torch's elastic launcher parses endpoints more loosely and fails later, with a traceback.
"""

from __future__ import annotations

import ipaddress
import re
from typing import TypeGuard

from gaudi3_scale.config.errors import ConfigError, brief

__all__ = ["ENDPOINT_FORM", "is_host", "parse_endpoint"]

_HOST_LABEL = "[A-Za-z0-9](?:[-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*", re.ASCII)
_HOSTNAME_MAX = 253
ENDPOINT_FORM = "HOST:PORT (a host name, an IPv4 address or a bracketed IPv6 address, and a port 1-65535)"


def _ip_version(value: str) -> int | None:
    try:
        return ipaddress.ip_address(value).version
    except ValueError:
        return None


def is_host(value: object) -> TypeGuard[str]:
    """A host name or an IP address, without a zone id."""
    if not isinstance(value, str) or "%" in value:
        return False
    if _ip_version(value) is not None:
        return True
    return len(value) <= _HOSTNAME_MAX and _HOSTNAME.fullmatch(value) is not None


def parse_endpoint(field: str, value: str) -> tuple[str, int]:
    """(host, port) of `value`, the IPv6 brackets taken off; else `ConfigError(field, …)` naming the fault."""
    host, sep, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]") and _ip_version(host[1:-1]) == 6 and "%" not in host:
        host = host[1:-1]
    elif not sep or not is_host(host) or _ip_version(host) == 6 or _bad_ipv4(host):
        raise ConfigError(
            field, f"expected {ENDPOINT_FORM}, e.g. node0:29500; got {brief(value)}{_hint(value)}"
        )
    if not (
        port_text.isascii() and port_text.isdigit() and len(port_text) <= 5 and 0 < int(port_text) < 65536
    ):
        raise ConfigError(field, f"the port must be 1-65535, got {brief(port_text)} in {brief(value)}")
    return host, int(port_text)


def _bad_ipv4(host: str) -> bool:
    return host.replace(".", "").isdigit() and _ip_version(host) is None


def _hint(value: str) -> str:
    if _ip_version(value) == 6 or _ip_version(value.rpartition(":")[0]) == 6:
        return " (an IPv6 address goes in brackets: [fd00::1]:29500)"
    if ":" not in value:
        return " (no port)"
    if _bad_ipv4(value.rpartition(":")[0]):
        return " (not an IPv4 address)"
    return ""
