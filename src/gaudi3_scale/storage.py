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
    "is_local_filesystem",
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


def is_transient_error(error: BaseException) -> bool:
    """Whether a storage error may pass if retried: refused / reset / timed-out connections, 5xx and throttling.

    Errors reach us in three shapes: builtin `OSError`s (s3fs translates most S3 error codes, and turns unknown
    ones, 5xx included, into `OSError(EIO)`); botocore's own exceptions, which s3fs passes through untranslated
    (`EndpointConnectionError` for a refused connection is a `BotoCoreError`, not an `OSError`); aiohttp's
    `ClientError`s from the HTTP layer. Anything else (a bug, a bad request) is permanent: retrying would only hide it.
    """
    if isinstance(error, _PERMANENT_OS_ERRORS):
        return False
    if isinstance(error, OSError):  # ConnectionError, TimeoutError (asyncio's too), EIO
        return True
    for cls in type(error).__mro__:
        if cls.__module__ == "botocore.exceptions" and cls.__name__ in _TRANSIENT_BOTOCORE:
            return True
        if cls.__module__.startswith("aiohttp") and cls.__name__ == "ClientError":
            return True
    response = getattr(error, "response", None)  # botocore ClientError that s3fs did not translate
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = response.get("Error", {}).get("Code", "")
        return (isinstance(status, int) and status >= 500) or status == 429 or code in _THROTTLING_CODES
    return False


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
