"""The grammar of every user-supplied value a deployment is rendered from: one pattern per kind of field.

A value reaches a rendered file only after its field's check here passed (the file's own quoting, in
`deploy/quoting.py`, is the second line of defence, not the only one). A failed check is one line naming the field
and what it allows.

The patterns use the part of regular-expression syntax that Python's `re` and RE2 read alike (no `\\d`, `\\w` or
look-around), so the rendered Terraform validates a `-var` override with the very same pattern (`anchored`).
Each pattern is a concatenation (no top-level `|`), so anchoring it is only `^…$`.
"""

from __future__ import annotations

import re

from gaudi3_scale.config.errors import ConfigError, brief
from gaudi3_scale.config.hosts import is_host

__all__ = [
    "DNS_LABEL",
    "DNS_SUBDOMAIN",
    "GCP_PROJECT",
    "KEY_VAULT_NAME",
    "OCI_REFERENCE",
    "QUANTITY",
    "REGIONS",
    "RUN_NAME",
    "SECRET_NAME",
    "anchored",
    "check_dns_label",
    "check_dns_subdomain",
    "check_host",
    "check_image",
    "check_quantity",
    "check_region",
    "matches",
]

# OCI image reference, as github.com/distribution/reference's grammar (reference.go) defines it:
#   reference := name [":" tag] ["@" digest];  name := [domain "/"] path-component ["/" path-component]*
_ALNUM = "[a-z0-9]+"
_SEPARATOR = "(?:[._]|__|[-]+)"
_PATH_COMPONENT = f"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = "(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_IPV6_HOST = r"\[(?:[a-fA-F0-9:]+)\]"  # no zone identifier (the grammar leaves RFC 6874 out)
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|{_IPV6_HOST})(?::[0-9]+)?"
_IMAGE_NAME = f"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = "[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = "[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
OCI_REFERENCE = f"{_IMAGE_NAME}(?::{_TAG})?(?:@{_DIGEST})?"
_IMAGE_NAME_MAX = 255  # distribution/reference RepositoryNameTotalLengthMax
_IMAGE_MAX = 1024  # a name, a tag and a sha512 digest fit; anything longer is not an image reference

# Kubernetes object names (apimachinery validation: IsDNS1123Label / IsDNS1123Subdomain).
DNS_LABEL = "[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
_SUBDOMAIN_LABEL = "[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = rf"{_SUBDOMAIN_LABEL}(?:\.{_SUBDOMAIN_LABEL})*"
_DNS_SUBDOMAIN_MAX = 253
# The run name prefixes every cloud resource name: a DNS label short enough for all of them.
RUN_NAME = "[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?"
# A Kubernetes resource quantity (apimachinery resource.Quantity), non-negative: 64, 500m, 1.5Gi, 1e3.
QUANTITY = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[KMGTPE]i|[mkMGTPE]|[eE][-+]?[0-9]+)?"

# Where each cloud target puts its nodes: (pattern, what the line says is allowed).
REGIONS = {
    "aws": ("[a-z]{2}(?:-[a-z]+)+-[0-9]+", "an AWS region such as us-east-1 or us-gov-west-1"),
    "azure": (
        "[a-z][a-z0-9]{1,39}",
        "an Azure location name such as eastus or westeurope (lower-case, no spaces)",
    ),
    "gcp": (
        "[a-z]+-[a-z]+[0-9]+-[a-z]",
        "gcp needs a zone such as us-central1-a (a compact placement policy is per zone)",
    ),
}
# Values only Terraform sees (`-var`), validated in the rendered variables.tf: a Google Cloud project id (optionally
# domain-scoped, example.com:my-project) and a secret's name in SSM Parameter Store / Key Vault / Secret Manager.
GCP_PROJECT = "(?:[a-z][-a-z0-9.]*[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]"
SECRET_NAME = "[A-Za-z0-9/_.-]{1,512}"
KEY_VAULT_NAME = "[a-zA-Z0-9-]{3,24}"  # Azure Key Vault naming rules


def anchored(pattern: str) -> str:
    """`pattern` matching a whole string, for RE2 (Terraform's regex(); its `$` is the end of the text)."""
    return f"^{pattern}$"


def matches(pattern: str, value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(pattern, value, re.ASCII) is not None


def check_image(value: object, field: str = "--image") -> str:
    if not (isinstance(value, str) and len(value) <= _IMAGE_MAX and matches(OCI_REFERENCE, value)) or (
        len(_image_name(value)) > _IMAGE_NAME_MAX
    ):
        raise ConfigError(
            field,
            "must be an OCI image reference such as registry.example.com/team/train:1.0 (lower-case name, "
            f"optional :tag of letters, digits, '_', '.', '-', optional @sha256:<hex>), got {brief(value)}",
        )
    return value


def _image_name(reference: str) -> str:
    """The repository name of a well-formed reference: without its digest and tag (a registry's :port stays)."""
    name = reference.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last) + last.index(":")] if ":" in last else name


def check_dns_label(value: object, field: str) -> str:
    if not matches(DNS_LABEL, value):
        raise ConfigError(
            field,
            "must be a Kubernetes name (DNS-1123 label: 1-63 lower-case letters, digits and '-', starting and "
            f"ending with a letter or digit), got {brief(value)}",
        )
    assert isinstance(value, str)
    return value


def check_dns_subdomain(value: object, field: str) -> str:
    if not matches(DNS_SUBDOMAIN, value) or len(str(value)) > _DNS_SUBDOMAIN_MAX:
        raise ConfigError(
            field,
            "must be a Kubernetes name (DNS-1123 subdomain: up to 253 lower-case letters, digits, '-' and '.', "
            f"each dot-separated part starting and ending with a letter or digit), got {brief(value)}",
        )
    assert isinstance(value, str)
    return value


def check_quantity(value: object, field: str) -> str:
    """A Kubernetes quantity; a YAML number (`--set cpu=16`, `cpu=1.5`) is taken as its text."""
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    if not matches(QUANTITY, text):
        raise ConfigError(
            field, f"must be a Kubernetes quantity such as 64, 500m or 512Gi, got {brief(value)}"
        )
    assert isinstance(text, str)
    return text


def check_region(target: str, value: object) -> str:
    if target not in REGIONS:
        raise ConfigError("--region", f"--target {target} takes no region (only {', '.join(REGIONS)} do)")
    pattern, allowed = REGIONS[target]
    if not matches(pattern, value):
        raise ConfigError("--region", f"{allowed}, got {brief(value)}")
    assert isinstance(value, str)
    return value


def check_host(value: object, field: str = "--hosts") -> str:
    """A host name or an IP address. IPv6 zone ids (fe80::1%eth0) are refused: a zone names an interface of one
    machine, and its free text would reach the nodes' environment files."""
    if is_host(value):
        return value
    raise ConfigError(
        field,
        "each host must be a host name (letters, digits, '-' and '.') or an IP address without a zone id, "
        f"got {brief(value)}",
    )
