"""The escaping layer (deploy/quoting.py) on arbitrary text, and the field grammars (deploy/grammar.py).

Each quoting function is checked by the consumer of its language: bash runs the quoted words, python-hcl2 parses
the HCL literals, PyYAML (and a loader with Go yaml.v2's extra scalar types) reads the YAML back, a re-implementation
of Kubernetes' `$(VAR)` expansion expands the args. A command substitution that ran would create a marker file.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import hcl2
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_readers import GoYamlLikeLoader, re2_fullmatch
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.deploy import grammar
from gaudi3_scale.deploy.quoting import (
    comment,
    dockerfile_exec,
    hcl_string,
    k8s_literal,
    sh_heredoc,
    sh_quote,
    yaml_text,
)

# Text a hostile user would try: every quoting and expansion syntax of the target languages, line breaks of every
# kind, and the bootstrap's heredoc delimiter alone on a line.
HOSTILE = [
    "img:1$(touch injected)",
    "`touch injected`",
    "a'b\"c\\d",
    "x\nGAUDI3_EOF\ntouch injected\n",
    '${file("/etc/passwd")}',
    '${"\\"\n"} %{ "\t" }',
    "%{ if true }yes%{ endif }",
    "$${x} $$ %%{y}",
    "$(HOME) $$(HOME) $HOME",
    "evil:1\nRUN curl x|sh",
    "\r\n\x85\u2028\u2029\x0b\x0c\t\x1b[2J\x7f",
    "[::1]:5000/y",
    "*",
    "-rf",
    "y",
    "1e3",
    "",
    "é ✓ 𝔘",
]
# hypothesis text weighted towards the characters that matter
_SPECIAL = "$%{}()`'\"\\\n\r\t #;|&*?[]!~<>=:@/\x00\x01\x85\u2028é𝔘yYnN0123456789eE.+-_"
# codec="utf-8": no lone surrogates (no file or argv can hold one)
TEXT = st.text(alphabet=st.sampled_from(_SPECIAL) | st.characters(codec="utf-8"), max_size=40)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- shell -------------------------------------------------------------------------------------------------------


def _bash_words(words: list[str], cwd: Path) -> list[str]:
    """What bash makes of each quoted word: printf prints each as one NUL-terminated field."""
    script = "printf '%s\\0' " + " ".join(sh_quote(w) for w in words)
    subprocess.run(["bash", "-n", "-c", script], check=True, cwd=cwd)
    done = subprocess.run(["bash", "-c", script], check=True, capture_output=True, cwd=cwd)
    return done.stdout.decode("utf-8", "surrogateescape").split("\0")[:-1]


def test_shell_words_are_literal(tmp_path: Path) -> None:
    (tmp_path / "1:5000").mkdir()
    (tmp_path / "1:5000" / "y").write_text("")  # an unquoted [::1]:5000/y would glob to 1:5000/y
    assert _bash_words(HOSTILE, tmp_path) == HOSTILE
    assert not (tmp_path / "injected").exists()
    assert sh_quote("registry.example.com/train:1.0") == "registry.example.com/train:1.0"  # bare when safe
    with pytest.raises(ValueError, match="NUL"):
        sh_quote("a\0b")


@FAST
@given(st.lists(TEXT.filter(lambda t: "\0" not in t), min_size=1, max_size=8))
def test_shell_words_are_literal_for_any_text(
    tmp_path_factory: pytest.TempPathFactory, words: list[str]
) -> None:
    cwd = tmp_path_factory.mktemp("sh")
    assert _bash_words(words, cwd) == words
    assert not (cwd / "injected").exists()


@FAST
@given(TEXT.filter(lambda t: "\0" not in t))
def test_a_heredoc_passes_any_text_through(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    cwd = tmp_path_factory.mktemp("heredoc")
    body = f"{text}\nGAUDI3_EOF\n$(touch injected)\n"
    script = sh_heredoc("cat > out", body) + "echo done\n"
    subprocess.run(["bash", "-c", script], check=True, cwd=cwd)
    assert (cwd / "out").read_bytes().decode("utf-8", "surrogateescape") == body
    assert not (cwd / "injected").exists()
    with pytest.raises(ValueError, match="newline"):
        sh_heredoc("cat", "no newline")


# ---- HCL ---------------------------------------------------------------------------------------------------------

_STRIP = hcl2.SerializationOptions(strip_string_quotes=True)
_HCL_ESCAPE = re.compile(r'\\(?:[nrt"\\]|u[0-9a-f]{4}|U[0-9a-f]{8})')


def _hcl_roundtrip(value: str) -> str:
    literal = hcl_string(value)
    # Only HCL's own escapes (python-hcl2 would also take JSON's \b or \f, Terraform would not) and no bare
    # template sequence: `${` / `%{` appear only escaped, as `$${` / `%%{`.
    inner = literal[1:-1]
    assert all(_HCL_ESCAPE.fullmatch(m.group()) for m in re.finditer(r"\\(?:u.{4}|U.{8}|.)", inner)), literal
    assert not re.search(r"(?<!\$)\$\{|(?<!%)%\{", inner.replace("$${", "").replace("%%{", "")), literal
    parsed = hcl2.loads(f"x = {literal}\n", serialization_options=_STRIP)["x"]
    # python-hcl2 resolves backslash escapes, but keeps an escaped template sequence (`$${…}` / `%%{…}`) as
    # written, escapes inside it included; HCL resolves those too and reads `$${` / `%%{` as `${` / `%{`.
    parsed = re.sub(r"(?:\$\$|%%)\{[^}]*\}", lambda m: _hcl_unescape(m.group()), parsed)
    return parsed.replace("$${", "${").replace("%%{", "%{")


def _hcl_unescape(text: str) -> str:
    simple = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\"}
    return re.sub(
        r"\\(u[0-9a-f]{4}|U[0-9a-f]{8}|.)",
        lambda m: chr(int(m.group(1)[1:], 16)) if len(m.group(1)) > 1 else simple[m.group(1)],
        text,
    )


def _hcl2_can_parse(value: str) -> bool:
    """python-hcl2's grammar needs a `}` after an escaped `$${` / `%%{` (real HCL does not)."""
    return not re.search(r"[$%]\{[^}]*$", value)


@pytest.mark.parametrize("value", [v for v in HOSTILE if _hcl2_can_parse(v)])
def test_hcl_strings_round_trip(value: str) -> None:
    assert _hcl_roundtrip(value) == value


@FAST
@given(TEXT.filter(lambda t: "\0" not in t and _hcl2_can_parse(t)))
def test_hcl_strings_round_trip_for_any_text(value: str) -> None:
    assert _hcl_roundtrip(value) == value


def test_hcl_strings_escape_what_hcl2_cannot_check() -> None:
    """Unbalanced template openers (python-hcl2 cannot parse their escapes, HCL can) and JSON-only escapes."""
    assert hcl_string("a${b") == '"a$${b"' and hcl_string("%{") == '"%%{"'
    assert hcl_string("\b\f\x00\u2028") == '"\\u0008\\u000c\\u0000\\u2028"'
    assert hcl_string("𝔘\U000e0001") == '"𝔘\\U000e0001"'


# ---- YAML --------------------------------------------------------------------------------------------------------


def _yaml_roundtrip(value: object) -> None:
    text = yaml_text(value)
    assert yaml.safe_load(text) == value
    assert yaml.load(text, Loader=GoYamlLikeLoader) == value


@pytest.mark.parametrize("value", HOSTILE)
def test_yaml_keeps_strings_strings(value: str) -> None:
    _yaml_roundtrip(value)
    _yaml_roundtrip({value: [value, {"k": value}]})


@FAST
@given(st.recursive(TEXT | st.integers() | st.booleans() | st.none(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8))  # fmt: skip
def test_yaml_round_trips_any_document(value: object) -> None:
    _yaml_roundtrip(value)


# ---- comments, Dockerfile exec form, Kubernetes expansion ---------------------------------------------------------


@FAST
@given(TEXT)
def test_a_comment_is_one_line_in_every_language(text: str) -> None:
    line = f"# {comment(text)}"
    assert len(line.splitlines()) == 1 and line.isprintable()  # splitlines: \n, \r, \x85, \u2028, …
    assert yaml.safe_load(f"{line}\nk: v\n") == {"k": "v"}
    assert comment("plain text → kept") == "plain text → kept"


@FAST
@given(st.lists(TEXT, max_size=5))
def test_the_dockerfile_exec_form_is_one_json_line(argv: list[str]) -> None:
    text = dockerfile_exec(argv)
    assert "\n" not in text and "\r" not in text and json.loads(text) == argv


def _k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of container command / args / env values (third_party/forked/golang/expansion):
    `$$` is `$`, `$(NAME)` the variable's value when it is defined (else left as written)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            end = text.find(")", i + 2)
            if nxt == "(" and end != -1:
                name = text[i + 2 : end]
                out.append(env.get(name, f"$({name})"))
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


@FAST
@given(TEXT)
def test_kubernetes_does_not_expand_a_literal(value: str) -> None:
    env = {"HOME": "EXPANDED", "AWS_SECRET_ACCESS_KEY": "LEAKED"}
    assert _k8s_expand(k8s_literal(value), env) == value
    assert _k8s_expand(k8s_literal("$(AWS_SECRET_ACCESS_KEY)"), env) == "$(AWS_SECRET_ACCESS_KEY)"
    assert _k8s_expand("$(AWS_SECRET_ACCESS_KEY)", env) == "LEAKED"  # what the escape prevents


# ---- grammars ----------------------------------------------------------------------------------------------------

DIGEST = "sha256:" + "0123456789abcdef" * 4
GOOD_IMAGES = [
    "ubuntu", "y", "1e3", "library/ubuntu:22.04", "registry.example.com/team/train:1.0",
    "localhost:5000/a__b/c--d/e.f:Tag_1.x-y", "[::1]:5000/img:1", "Registry.Example.COM/x",
    f"img@{DIGEST}", f"a/b:c@{DIGEST}", "a:" + "t" * 128,
]  # fmt: skip
BAD_IMAGES = [
    "", "evil:1\nRUN curl x|sh", "img:1$(id>/tmp/f)", "img:1\n", "Img:1", "a b", "a//b", "a/b/", "-a", "a-",
    ":tag", "a:", "a:b:c", "a:-x", "a@sha256:abc", "a:" + "t" * 129, "a" * 256 + "/b", "[fe80::1%eth0]/x",
    "a:b\x00", "img;rm", "'img'", "img:1 ",
]  # fmt: skip


@pytest.mark.parametrize("image", GOOD_IMAGES)
def test_oci_references_that_are_accepted(image: str) -> None:
    assert grammar.check_image(image) == image


@pytest.mark.parametrize("image", BAD_IMAGES)
def test_oci_references_that_are_refused(image: str) -> None:
    with pytest.raises(UserInputError, match=r"^--image: must be an OCI image reference") as info:
        grammar.check_image(image)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("check", "good", "bad"),
    [
        (lambda v: grammar.check_dns_label(v, "namespace"), ["a", "0755", "1e3", "a-b", "a" * 63],
         ["", "A", "a_b", "a.b", "-a", "a-", "a" * 64, "a\n", "a b", "a$(id)"]),
        (lambda v: grammar.check_dns_subdomain(v, "storage_class"), ["a", "a.b-c", "1.5", "a" * 63 + ".b"],
         ["", "a..b", ".a", "a.", "a_b", "A", "a\n", "a" * 254, "x;y"]),
        (lambda v: grammar.check_quantity(v, "cpu"), ["64", "500m", "1.5Gi", "1e3", ".5", "1.", 16, 1.5],
         ["", "1 Gi", "1Gi\n", "-1", "1.5.5", "Gi", "1;reboot", True, float("nan"), -2]),
        (grammar.check_host, ["gpu-a.lab", "123", "y", "10.1.2.3", "::1", "fe80::1", "a" * 63],
         ["", "a b", "-oProxyCommand=x", "a..b", "a" * 64, "fe80::1%eth0", "fe80::1%a\nIMAGE=evil:1", "a$(id)"]),
    ],
)  # fmt: skip
def test_field_grammars(check: Callable[[object], str], good: list[object], bad: list[object]) -> None:
    for value in good:
        assert check(value) == str(value), value
    for value in bad:
        with pytest.raises(UserInputError):
            check(value)


@pytest.mark.parametrize(
    ("target", "good", "bad"),
    [
        ("aws", ["us-east-1", "us-gov-west-1", "ap-southeast-4", "us-isob-east-1"],
         ["us-east", "US-EAST-1", "us-east-1\n", 'us-east-1"; rm', "${var.x}"]),
        ("azure", ["eastus", "westus3", "eastus2euap", "usgovvirginia"], ["East US", "east-us", "e", "eastus\n"]),
        ("gcp", ["us-central1-a", "europe-west4-b", "northamerica-northeast1-c", "me-central2-a"],
         ["us-central1", "us-central1-ab", "US-CENTRAL1-A", "us-central1-a\n"]),
    ],
)  # fmt: skip
def test_regions_per_cloud(target: str, good: list[str], bad: list[str]) -> None:
    for value in good:
        assert grammar.check_region(target, value) == value
    for value in bad:
        with pytest.raises(UserInputError, match=r"^--region: "):
            grammar.check_region(target, value)
    with pytest.raises(UserInputError, match=r"--target k8s takes no region"):
        grammar.check_region("k8s", "us-east-1")


@pytest.mark.parametrize(
    ("pattern", "values"),
    [
        (grammar.OCI_REFERENCE, GOOD_IMAGES[:-1] + BAD_IMAGES[:-3]),
        (grammar.RUN_NAME, ["golden", "a", "a-", "a\n", "x" * 41]),
        (grammar.SECRET_NAME, ["/gaudi3/hf", "hf-token", "a\nb", "a b"]),
        (grammar.GCP_PROJECT, ["my-project", "example.com:my-project", "My-Project", "abc"]),
        *(
            (pattern, ["us-east-1", "eastus", "us-central1-a", "x\n"])
            for pattern, _ in grammar.REGIONS.values()
        ),
    ],
)
def test_terraform_reads_each_pattern_as_python_does(pattern: str, values: list[str]) -> None:
    for value in values:
        assert re2_fullmatch(grammar.anchored(pattern), value) == grammar.matches(pattern, value), value
