"""fsspec URLs, shared by checkpoints (`checkpoint.remote_url`) and datasets (`data.prepared_dir`, `data.source`).

fsspec and the backend for a protocol (s3fs for `s3://`, gcsfs for `gs://`, adlfs for `az://`) are optional:
imported here, lazily, and named in the error when missing. `file://` and `memory://` need nothing beyond fsspec.
Credentials and endpoints come from `storage_options` or the backend's own environment variables (for s3fs:
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from gaudi3_scale.config.errors import ConfigError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "URL_EXAMPLES",
    "copy_stream",
    "http_status",
    "is_local_filesystem",
    "is_missing_bucket",
    "is_storage_error",
    "is_transient_error",
    "open_remote",
    "url_protocol",
]

URL_EXAMPLES = (
    "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, file:///abs/path, memory://name"
)
CHUNK_BYTES = 8 * 2**20
_INSTALL = "pip install 'gaudi3-scale[remote]'"
# An OSError that retrying cannot fix: the object is absent, or the credentials may not read it.
_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
# botocore errors (by class name, so botocore need not be imported) that a later attempt can get past: the
# connection failed, was cut or timed out, or a body arrived damaged. `NoCredentialsError`, `ParamValidationError`
# and the other BotoCoreErrors describe the request itself and are permanent.
_TRANSIENT_BOTOCORE = {"ConnectionError", "HTTPClientError", "IncompleteReadError", "ChecksumError"}
_THROTTLING_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
}
# Besides 5xx: the request timed out at the server (408), or asked us to slow down (429).
_TRANSIENT_STATUSES = {408, 429}


def url_protocol(spec: str) -> str | None:
    """The `PROTOCOL` of `PROTOCOL://…`, or None for a plain path (no fsspec import needed)."""
    head, sep, _ = spec.partition("://")
    if not sep or not head or not all(c.isalnum() or c in "+-." for c in head) or not head[0].isalpha():
        return None
    return head.lower()


def _private_retry_jitter() -> None:
    """Give botocore's retry backoff a random generator of its own (s3:// goes through botocore).

    botocore draws the jitter of every retry delay from the global `random` (legacy mode:
    `botocore.retryhandler.delay_exponential`; standard and adaptive modes: `ExponentialBackoff`'s default
    `random=random.random`). Drawn on a background thread, that moved the Python RNG state that checkpoints record
    (`gaudi3_rng`), so a run whose storage had an outage was no longer bitwise identical to one without. The jitter
    needs no reproducibility: its own generator, seeded from the OS, leaves the global one alone.
    """
    try:
        import botocore.retries.standard as standard
        import botocore.retryhandler as legacy
    except ImportError:
        return
    jitter = random.Random()
    if legacy.random is random:  # the module-level `random.random()` call: route it to our generator
        legacy.random = jitter
    init = standard.ExponentialBackoff.__init__
    if init.__defaults__ is not None:
        init.__defaults__ = tuple(jitter.random if d == random.random else d for d in init.__defaults__)


def open_remote(
    url: str, storage_options: dict[str, Any] | None = None, *, field: str
) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem and root path of `url`; anything wrong with the URL is one `ConfigError` line that
    starts with `field` (the config field the URL came from, e.g. `checkpoint.remote_url`)."""
    try:
        import fsspec
        from fsspec.registry import known_implementations, registry
    except ImportError as e:
        raise ConfigError(field, f"{url!r} needs fsspec, which is not installed; {_INSTALL}") from e
    protocol, _ = fsspec.core.split_protocol(url)
    _private_retry_jitter()
    if protocol is None:
        raise ConfigError(field, f"{url!r} has no protocol; use a URL such as {URL_EXAMPLES}")
    if protocol not in known_implementations and protocol not in registry:
        raise ConfigError(
            field,
            f"unknown protocol {protocol!r} in {url!r}; allowed: any fsspec protocol, e.g. {URL_EXAMPLES}",
        )
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        hint = known_implementations.get(protocol, {}).get("err") or str(e)
        raise ConfigError(
            field, f"{url!r} needs a package that is not installed ({hint}); s3:// comes with {_INSTALL}"
        ) from e
    except (TypeError, ValueError) as e:
        raise ConfigError(field, f"{url!r} with storage options {storage_options}: {e}") from e
    except OSError as e:  # a backend that connects at once (ftp://, sftp://): unknown host, refused
        raise ConfigError(field, f"cannot reach {url!r}: {type(e).__name__}: {e}") from None
    if not root.strip("/") and protocol != "file":
        raise ConfigError(field, f"{url!r} names no bucket or path; use a URL such as {URL_EXAMPLES}")
    return fs, root.rstrip("/")


# Where the exceptions of fsspec's backends come from besides OSError: botocore (s3fs passes NoCredentialsError,
# EndpointConnectionError … through), aiohttp (http, gcsfs, adlfs), google.auth / azure.core (credentials).
_STORAGE_ERROR_MODULES = ("botocore.", "aiobotocore.", "aiohttp.", "google.auth.", "azure.core.")


def is_storage_error(error: BaseException) -> bool:
    """Whether `error` came from the store (unreachable, credentials, permissions, a missing bucket), not from a bug
    of ours: what a command turns into one line naming the URL."""
    if isinstance(error, OSError):
        return True
    return any(cls.__module__.startswith(_STORAGE_ERROR_MODULES) for cls in type(error).__mro__)


def http_status(error: BaseException) -> int | None:
    """The HTTP status of an aiohttp response error, or of the one fsspec's http backend wrapped (its `_info` turns
    any failed HEAD/GET, a 503 included, into `FileNotFoundError(url)` with the response error as the cause)."""
    for candidate in (error, error.__cause__):
        status = getattr(candidate, "status", None)
        if isinstance(status, int) and not isinstance(status, bool):
            return status
    return None


def _botocore_response(error: BaseException) -> tuple[int | None, str]:
    """(HTTP status, error code) of a botocore `ClientError`, or of the one s3fs translated into a builtin OSError
    (`translate_boto_error` keeps it as the cause: `NoSuchBucket` → `FileNotFoundError`, `SlowDown` → `OSError`)."""
    for candidate in (error, error.__cause__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code", "")
            return (status if isinstance(status, int) else None), str(code)
    return None, ""


def is_missing_bucket(error: BaseException) -> bool:
    """Whether `error` says the bucket itself does not exist (S3's `NoSuchBucket`), not merely the object: a listing
    of an empty prefix and a typo in the bucket name both end in `FileNotFoundError`, and only the first is "nothing
    stored yet"."""
    return _botocore_response(error)[1] == "NoSuchBucket"


def is_transient_error(error: BaseException) -> bool:
    """Whether a storage error may pass if retried: refused / reset / timed-out connections, throttling, and an
    HTTP status of 5xx, 408 or 429. Any other status (403 refused, 404 missing, 400 a bad request) is permanent, and
    so is anything else (a bug, bad credentials): retrying would only hide it until the retry budget ran out.

    Errors reach us in four shapes, and a status wins over the shape: botocore's `ClientError` (status and code in
    `response`), also as the cause of the builtin `OSError` s3fs translates it into (unknown codes, 5xx included,
    become `OSError(EIO)`); aiohttp's `ClientResponseError` (`status`), also as the cause of the `FileNotFoundError`
    fsspec's http backend wraps every failed request in, a refused connection too; builtin `OSError`s; botocore's
    own exceptions, which s3fs passes through (`EndpointConnectionError` is a `BotoCoreError`, not an `OSError`).
    """
    status, code = _botocore_response(error)
    if status is None:
        status = http_status(error)
    if code in _THROTTLING_CODES:
        return True
    if status is not None:
        return status >= 500 or status in _TRANSIENT_STATUSES
    if isinstance(error, _PERMANENT_OS_ERRORS):
        # but fsspec http wraps a connection that failed in FileNotFoundError too: its cause decides
        return isinstance(error, FileNotFoundError) and _is_transient_cause(error)
    if isinstance(error, OSError):  # ConnectionError, TimeoutError (asyncio's too), EIO
        return True
    for cls in type(error).__mro__:
        if cls.__module__ == "botocore.exceptions" and cls.__name__ in _TRANSIENT_BOTOCORE:
            return True
        # aiohttp: disconnected, a payload cut short (a response error has a status, handled above)
        if cls.__module__.startswith("aiohttp") and cls.__name__ == "ClientError":
            return True
    return False


def _is_transient_cause(error: BaseException) -> bool:
    cause = error.__cause__
    return cause is not None and cause is not error and is_transient_error(cause)


def is_local_filesystem(fs: AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return "file" in protocols


def copy_stream(
    src: BinaryIO, dst: BinaryIO | None, progress: Callable[[int], None] | None = None
) -> tuple[int, str]:
    """Stream `src` into `dst` (None: only read) and return (size_bytes, SHA-256 of the bytes read)."""
    digest, size_bytes = hashlib.sha256(), 0
    while chunk := src.read(CHUNK_BYTES):
        if dst is not None:
            dst.write(chunk)
        digest.update(chunk)
        size_bytes += len(chunk)
        if progress is not None:
            progress(len(chunk))
    return size_bytes, digest.hexdigest()
