"""gaudi3_scale.storage: which storage errors are worth retrying, and URL recognition."""

from __future__ import annotations

import errno

import pytest

from gaudi3_scale.storage import is_transient_error, url_protocol


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    response = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "GetObject")  # type: ignore[arg-type]


def test_builtin_os_errors() -> None:
    assert is_transient_error(ConnectionRefusedError())
    assert is_transient_error(ConnectionResetError())
    assert is_transient_error(TimeoutError())
    assert is_transient_error(OSError(errno.EIO, "InternalError"))  # s3fs: an untranslated 5xx
    assert not is_transient_error(FileNotFoundError("bucket/key"))
    assert not is_transient_error(PermissionError("AccessDenied"))
    assert not is_transient_error(ValueError("bad"))
    assert not is_transient_error(KeyError("bug"))


def test_botocore_errors() -> None:
    exceptions = pytest.importorskip("botocore.exceptions")
    assert is_transient_error(exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient_error(exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient_error(exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1:1"))
    assert not is_transient_error(exceptions.NoCredentialsError())
    assert not is_transient_error(exceptions.ParamValidationError(report="bad"))
    assert is_transient_error(_client_error(503, "ServiceUnavailable"))
    assert is_transient_error(_client_error(400, "SlowDown"))
    assert not is_transient_error(_client_error(403, "AccessDenied"))


def test_aiohttp_errors() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    assert is_transient_error(aiohttp.ServerDisconnectedError())
    assert is_transient_error(aiohttp.ClientPayloadError("cut"))


def test_url_protocol() -> None:
    assert url_protocol("s3://bucket/key") == "s3"
    assert url_protocol("GS://b") == "gs"
    assert url_protocol("simplecache::s3://b") is None  # chained URLs are not supported as dataset URLs
    assert (
        url_protocol("/abs/path") is None and url_protocol("C:\\x") is None and url_protocol("hf:x") is None
    )
