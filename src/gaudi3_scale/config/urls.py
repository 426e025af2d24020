"""URLs in user input: the endpoint check, and the one check that no value carries credentials.

`check_no_credentials` is applied to every string a config holds, in any section and however nested (a
`data.mixture` member's source, a tracker URI, a remote checkpoint URL), as `config.core` reads it: so
`gaudi3 train`, `prepare`, `tune`, `benchmark` and `deploy render` refuse a URL with credentials alike, before
anything is written. The resolved config goes into the run directory (`config.yaml`), into every tracker's
hyperparameters, into checkpoints and into the rendered deployment files (Terraform user data, `docker/run.yaml`,
`ansible/files/run.yaml`, the Kubernetes ConfigMap), which docs/how-to/deploy.md promises never hold a secret.
Credentials come from the backend's own environment instead (s3fs: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; MLflow:
MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN), which a deployment fills from a
secret it references by name (k8s.credentials_secret, the Terraform `secrets` variable).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from gaudi3_scale.config.errors import ConfigError, brief

__all__ = ["check_http_url", "check_no_credentials"]

# scheme "://" authority, the authority ending at the path, query or fragment (RFC 3986 §3.2). The authority is a
# look-ahead, not consumed, so that a second URL right after the first (`a://x,b://user:pw@host`) is found too.
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(?=([^/?#\s]*))")
# Azure's `abfs[s]://<container>@<account>.dfs.core.windows.net/` (adlfs takes it for az:// too): the part before
# '@' is a container, not a user. With a ':' in it, it is a password all the same.
_CONTAINER_AT_ACCOUNT = ("abfs", "abfss", "az")


# Query parameters that carry a credential: presigned S3 (SigV4; SigV2's `Signature`) and GCS (V4; V2's
# `Signature`) URLs, Azure SAS tokens (`sig`, with `sv`), OAuth bearer tokens, API keys and passwords. Compared
# case-insensitively; a value ends at '&', ';', '#', ',' (a list of URLs) or whitespace.
CREDENTIAL_QUERY_PARAMS = (
    "x-amz-signature",
    "x-amz-credential",
    "x-amz-security-token",
    "x-goog-signature",
    "x-goog-credential",
    "signature",
    "sig",
    "token",
    "access_token",
    "api_key",
    "apikey",
    "password",
    "client_secret",
)
_QUERY_PARAM = re.compile(r"([?&;])([^=&;#\s,?]+)=([^&;#\s,]*)")
# Where a URL's query string ends: whitespace, ',' followed by the next URL, or its fragment.
_QUERY_END = re.compile(r"\s|,(?=[A-Za-z][A-Za-z0-9+.-]*://)|#")


def check_no_credentials(name: str, value: str) -> None:
    """Refuse `value` when a URL in it has userinfo (`user:password@` or a token as `user@`), or a credential in
    its query string (CREDENTIAL_QUERY_PARAMS: a presigned URL, an Azure SAS, `?token=`), naming `name`. The line
    shows the value with every secret of every URL in it masked, never a secret."""
    secrets: list[tuple[int, int]] = []  # spans of `value` to mask
    userinfo_found, params = False, set()
    for match in _URL.finditer(value):
        scheme, authority = match.group(1).lower(), match.group(2)
        userinfo, at, _ = authority.rpartition("@")
        if at and not (scheme in _CONTAINER_AT_ACCOUNT and ":" not in userinfo):
            secrets.append((match.end(), match.end() + len(userinfo)))
            userinfo_found = True
        for param in _query_secrets(value, match.end()):
            secrets.append((param.start(3), param.end(3)))
            params.add(param.group(2))
    if not secrets:
        return
    where = (["before '@'"] if userinfo_found else []) + (
        [f"in its query string ({', '.join(sorted(params))})"] if params else []
    )
    raise ConfigError(
        name,
        f"{brief(_masked(value, secrets))} carries credentials {' and '.join(where)} (they would be written into "
        "config.yaml, the trackers and rendered deploy files); remove them and use the backend's credential "
        "environment (e.g. AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD) or a secret reference "
        "(k8s.credentials_secret)",
    )


def _query_secrets(value: str, start: int) -> list[re.Match[str]]:
    """The credential parameters in the query string of the URL whose authority starts at `start`."""
    stop = _QUERY_END.search(value, start)
    end = stop.start() if stop else len(value)
    query = value.find("?", start, end)
    if query < 0:
        return []
    return [
        m for m in _QUERY_PARAM.finditer(value, query, end) if m.group(2).lower() in CREDENTIAL_QUERY_PARAMS
    ]


def _masked(value: str, spans: list[tuple[int, int]]) -> str:
    """`value` with each span (overlapping ones merged) replaced by `***`."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    for start, end in reversed(merged):  # from the end, so that earlier offsets stay valid
        value = f"{value[:start]}***{value[end:]}"
    return value


def check_http_url(name: str, url: str | None) -> None:
    """An http(s)://HOST[:PORT]/PATH URL (an endpoint we send requests to), or None; else one line naming `name`.
    Checked up front: boto3 would ask for credentials first and urllib name an 'unknown url type', both later."""
    if url is None:
        return
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise ConfigError(name, f"{brief(url)}: {exc}; expected http(s)://HOST[:PORT]/PATH") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            name,
            f"expected an http:// or https:// URL with a host (http(s)://HOST[:PORT]/PATH), got {brief(url)}",
        )
