"""gaudi3_scale.storage: which storage errors are worth retrying, and URL recognition."""

from __future__ import annotations

import errno

import pytest

from gaudi3_scale.storage import http_status, is_missing_bucket, is_transient_error, url_protocol


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    response = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "GetObject")  # type: ignore[arg-type]


def _response_error(status: int) -> Exception:
    import aiohttp

    return aiohttp.ClientResponseError(None, (), status=status, message="m")  # type: ignore[arg-type]


def _s3fs_translated(status: int, code: str) -> Exception:
    """What s3fs raises for a `ClientError`: a builtin exception with the botocore error as its cause."""
    from s3fs.errors import translate_boto_error

    error = translate_boto_error(_client_error(status, code))
    assert isinstance(error, OSError) and isinstance(error.__cause__, Exception)
    return error


def _wrapped_by_fsspec_http(cause: Exception) -> FileNotFoundError:
    """What fsspec's http backend raises for any failed HEAD/GET: `FileNotFoundError(url)` caused by the error."""
    error = FileNotFoundError("http://127.0.0.1:1/ds/manifest.json")
    error.__cause__ = cause
    return error


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
    assert not is_transient_error(_client_error(404, "NoSuchBucket"))
    assert not is_transient_error(_client_error(400, "InvalidArgument"))
    assert is_transient_error(_client_error(500, "InternalError"))
    assert is_transient_error(_client_error(429, "TooManyRequests"))
    assert is_transient_error(_client_error(408, "RequestTimeout"))
    assert is_transient_error(_client_error(400, "ThrottlingException"))


def test_s3fs_translated_errors_are_classified_by_the_status_they_carry() -> None:
    pytest.importorskip("s3fs", reason="needs the `remote` extra")
    assert not is_transient_error(_s3fs_translated(403, "AccessDenied"))  # PermissionError
    assert not is_transient_error(_s3fs_translated(404, "NoSuchBucket"))  # FileNotFoundError
    assert not is_transient_error(_s3fs_translated(400, "InvalidBucketName"))  # OSError(EIO): a bad request
    assert is_transient_error(_s3fs_translated(503, "ServiceUnavailable"))  # OSError(EBUSY)
    assert is_transient_error(_s3fs_translated(503, "SlowDown"))
    assert is_transient_error(_s3fs_translated(500, "InternalError"))
    assert is_transient_error(_s3fs_translated(400, "RequestTimeout"))  # TimeoutError


def test_missing_bucket_is_told_from_a_missing_object() -> None:
    pytest.importorskip("s3fs", reason="needs the `remote` extra")
    assert is_missing_bucket(_s3fs_translated(404, "NoSuchBucket"))
    assert is_missing_bucket(_client_error(404, "NoSuchBucket"))
    assert not is_missing_bucket(_s3fs_translated(404, "NoSuchKey"))
    assert not is_missing_bucket(FileNotFoundError("bucket/key"))


def test_aiohttp_errors() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    assert is_transient_error(aiohttp.ServerDisconnectedError())
    assert is_transient_error(aiohttp.ClientPayloadError("cut"))
    assert is_transient_error(aiohttp.ClientConnectionError("refused"))
    assert is_transient_error(aiohttp.ServerTimeoutError("slow"))


@pytest.mark.parametrize(("status", "transient"), [(403, False), (404, False), (400, False), (410, False),
                                                    (500, True), (503, True), (408, True), (429, True)])  # fmt: skip
def test_an_http_status_decides_alone_or_wrapped_by_fsspec_http(status: int, transient: bool) -> None:
    pytest.importorskip("aiohttp")
    assert is_transient_error(_response_error(status)) is transient
    wrapped = _wrapped_by_fsspec_http(_response_error(status))
    assert is_transient_error(wrapped) is transient
    assert http_status(wrapped) == status


def test_fsspec_http_wrapping_of_a_failed_connection_is_transient() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    assert is_transient_error(_wrapped_by_fsspec_http(aiohttp.ClientConnectionError("refused")))
    assert is_transient_error(_wrapped_by_fsspec_http(TimeoutError()))
    assert is_transient_error(_wrapped_by_fsspec_http(ConnectionRefusedError()))
    assert not is_transient_error(_wrapped_by_fsspec_http(ValueError("bad")))
    assert http_status(_wrapped_by_fsspec_http(TimeoutError())) is None


def test_url_protocol() -> None:
    assert url_protocol("s3://bucket/key") == "s3"
    assert url_protocol("GS://b") == "gs"
    assert url_protocol("simplecache::s3://b") is None  # chained URLs are not supported as dataset URLs
    assert (
        url_protocol("/abs/path") is None and url_protocol("C:\\x") is None and url_protocol("hf:x") is None
    )
