"""Credentials in a URL's query string (a presigned S3 or GCS URL, an Azure SAS, `?token=`) are refused like
userinfo credentials (test_url_credentials.py), by the same check `config.urls.check_no_credentials`, with the value
masked: the resolved config is written into config.yaml, the trackers and every rendered deployment file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.urls import check_no_credentials

Cli = Callable[..., tuple[int, str, str]]
SECRET = "d34dbeefS3cret"
REFUSED = [
    f"https://example.com/data.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature={SECRET}",
    f"https://bucket.s3.amazonaws.com/k?X-Amz-Credential={SECRET}%2F20260101%2Fus-east-1",
    f"https://storage.googleapis.com/b/o?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature={SECRET}",
    f"https://storage.googleapis.com/b/o?x-goog-credential={SECRET}",  # any case
    f"https://acct.blob.core.windows.net/c/blob?sv=2022-11-02&ss=b&sig={SECRET}",  # an Azure SAS
    f"https://mlflow.example.com/?token={SECRET}",
    f"https://api.example.com/x?a=1&access_token={SECRET}#frag",
    f"synthetic,https://a.example.com/x?q=1,https://b.example.com/y?sig={SECRET}",  # the second URL of a list
]
PASSES = [
    "https://example.com/data.txt?version=3&format=jsonl",
    "https://a.example.com/x?tokenizer=gpt2&signature_algo=none",  # names that only start like a credential's
    "https://a.example.com/x#token=1",  # a fragment, not a query
    "s3://bucket/prefix?versionId=abc",
    "https://mlflow.example.com:5000/x?a=b@c",
]


@pytest.mark.parametrize("value", REFUSED)
def test_query_string_credentials_are_refused_masked(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^f: .*credentials in its query string") as caught:
        check_no_credentials("f", value)
    assert SECRET not in str(caught.value) and "***" in str(caught.value)


@pytest.mark.parametrize("value", PASSES)
def test_other_query_strings_pass(value: str) -> None:
    check_no_credentials("f", value)


@pytest.mark.parametrize(
    ("section", "key"), [("data", "source"), ("monitor", "mlflow_tracking_uri"), ("checkpoint", "remote_url")]
)
def test_render_refuses_a_presigned_url_and_writes_nothing(
    gaudi3_cli: Cli, tmp_path: Path, section: str, key: str
) -> None:
    config = {"name": "leak", "model": {"name": "gpt2-124m"}, "train": {"global_batch_size": 16, "max_steps": 5},
              section: {key: REFUSED[0]}}  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out, err = gaudi3_cli("deploy", "render", "--target", "ci", "--accelerator", "h100", "--nodes", "1",
                                "--config", str(path), "--out", str(tmp_path / "o"))  # fmt: skip
    assert code == 2 and out == "", err
    assert err.startswith("gaudi3: error: ") and f" {section}.{key}: " in err and err.count("\n") == 1, err
    assert SECRET not in err and not (tmp_path / "o").exists()


# Every secret of every URL in one value, of both kinds: short enough that `brief` shows the whole value, so a
# secret left unmasked would be in the line (a query check that masked only its own URL printed the others').
MIXED = [
    ("https://alice:Pw1Secret@h/d?sig=Q1Secret", ("Pw1Secret", "Q1Secret"), ("before '@'", "query string (sig)")),
    ("https://a/x?sig=Q1Secret,https://b/y?sig=Q2Secret", ("Q1Secret", "Q2Secret"), ("query string (sig)",)),
    ("https://a/x?X-Amz-Signature=Q1Secret,https://bob:Pw2Secret@h2/x", ("Q1Secret", "Pw2Secret"),
     ("before '@'", "(X-Amz-Signature)")),
    ("https://bob:Pw1Secret@h1/x,https://eve:Pw2Secret@h2/y", ("Pw1Secret", "Pw2Secret"), ("before '@'",)),
    ("https://b/k?AWSAccessKeyId=AKIA&Signature=Q1Secret", ("Q1Secret",), ("(Signature)",)),  # SigV2 presigned
    ("https://a/x?u=https://b/y?sig=Q1Secret", ("Q1Secret",), ("(sig)",)),  # a URL inside a query
    ("https://api/x?api_key=Q1Secret&password=Q2Secret", ("Q1Secret", "Q2Secret"), ("(api_key, password)",)),
]  # fmt: skip


@pytest.mark.parametrize(("value", "secrets", "says"), MIXED)
def test_every_secret_of_every_url_is_masked(
    value: str, secrets: tuple[str, ...], says: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError, match=r"^f: ") as caught:
        check_no_credentials("f", value)
    line = str(caught.value)
    assert "…" not in line.split(" carries ")[0], (
        line
    )  # the whole value is shown: nothing hidden by truncation
    assert not [secret for secret in secrets if secret in line], line
    assert all(part in line for part in says), line
