"""The one YAML/JSON reader (`config.files`): every hostile file is one short line, refused quickly."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gaudi3_scale.config import files
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.config.files import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_NODES,
    load_json_file,
    load_yaml_file,
    parse_json,
    parse_yaml,
    parse_yaml_documents,
    parse_yaml_value,
)


def alias_bomb(levels: int = 8, width: int = 10) -> str:
    """The "billion laughs" document: each anchor lists the previous one `width` times (8 × 10: 10**9 values)."""
    names = "abcdefghijklmnopqrstuvwxyz"
    lines = [f"a: &a [{','.join(['lol'] * width)}]"]
    for prev, name in itertools.pairwise(names[: levels + 1]):
        lines.append(f"{name}: &{name} [{','.join([f'*{prev}'] * width)}]")
    return "\n".join(lines) + "\n"


def _refusal(path: Path, text: str | bytes) -> str:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(UserInputError) as info:
        load_yaml_file(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    assert str(path) in message
    return message


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"name: \xff\xfe\x00x\n", "byte 0xff at offset 6 (line 1)"),
        ("seed: 1\nname: café\n".encode("latin-1"), "byte 0xe9 at offset 17 (line 2)"),
    ],
)
def test_a_file_that_is_not_utf8_names_the_byte_and_where(tmp_path: Path, data: bytes, needle: str) -> None:
    message = _refusal(tmp_path / "run.yaml", data)
    assert "is not UTF-8 text" in message and needle in message


def test_utf8_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes("\ufeffname: café\n".encode())
    assert load_yaml_file(path) == {"name": "café"}


@pytest.mark.parametrize(
    "text",
    [
        "name: " + "[" * 5000 + "]" * 5000,  # flow: refused while scanning, not after 5000 levels
        "name: " + "{a: " * 3000 + "1" + "}" * 3000,
        "".join(" " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 5)),  # block nesting
        "a: &a "
        + "[" * 40
        + "1"
        + "]" * 40
        + "\nb: "
        + "[" * 30
        + "*a"
        + "]" * 30,  # deep only through an alias
    ],
)
def test_deep_nesting_is_refused(tmp_path: Path, text: str) -> None:
    assert f"nested deeper than {MAX_DEPTH} levels" in _refusal(tmp_path / "run.yaml", text)


def test_nesting_up_to_the_limit_is_read() -> None:
    depth = MAX_DEPTH - 1  # the mapping itself is one level
    data = parse_yaml("a: " + "[" * (depth - 1) + "1" + "]" * (depth - 1), where="w")
    for _ in range(depth):
        data = data["a"] if isinstance(data, dict) else data[0]
    assert data == 1


def test_an_alias_bomb_is_refused_at_once_with_a_short_line(tmp_path: Path) -> None:
    """In a fresh interpreter, so its peak memory is the bomb's alone; 401 bytes once took 37 s and 3.2 GB."""
    bomb = alias_bomb()
    assert len(bomb.encode()) <= 401  # the was 401 bytes
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb)
    probe = textwrap.dedent(f"""
        import re, time
        from gaudi3_scale.config.errors import UserInputError
        from gaudi3_scale.config.files import load_yaml_file
        start = time.perf_counter()
        try:
            load_yaml_file({str(path)!r})
        except UserInputError as exc:
            print(repr(str(exc)))
        print(time.perf_counter() - start)
        # VmHWM: this process's own peak (ru_maxrss can carry the forking parent's over exec)
        print(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    message, seconds, peak_kib = out.splitlines()
    assert "alias bomb" in message and len(message) < 300, message
    assert float(seconds) < 0.5, seconds  # measured: ~2 ms
    assert int(peak_kib) < 150 * 1024, peak_kib  # the interpreter with PyYAML: ~25 MB


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(UserInputError, match="refers to a node that contains it"):
        parse_yaml("a: &a [1, *a]\n", where="w")


def test_a_large_flat_document_is_refused_as_large_not_as_a_bomb(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MAX_NODES == 100_000
    monkeypatch.setattr(files, "MAX_NODES", 1000)  # the same code path, 100× less to parse
    with pytest.raises(UserInputError, match="holds more than 1,000 values") as info:
        parse_yaml("x: [" + "1," * 1001 + "1]", where="w")
    assert "alias" not in str(info.value)
    assert len(parse_yaml("x: [" + "1," * 900 + "1]", where="w")["x"]) == 901


def test_a_small_alias_is_fine() -> None:
    assert parse_yaml("a: &a {x: 1}\nb: *a\n", where="w") == {"a": {"x": 1}, "b": {"x": 1}}


def test_size_limit_and_file_kinds(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# " + b"x" * MAX_FILE_BYTES + b"\n")
    assert "larger than" in _refusal(big, big.read_bytes())
    with pytest.raises(UserInputError, match="is not a regular file"):
        load_yaml_file(tmp_path)
    with pytest.raises(UserInputError, match="does not exist"):
        load_yaml_file(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("max_steps: " + "9" * 5000, "an integer of 5,000 characters (at most 100)"),
        ("when: 2020-13-45\n", "cannot read '2020-13-45' at line 1, column 7: month must be in 1..12"),
        ("a: \x08\n", "not valid YAML"),
        ("a: !!python/object:os.system x\n", "not valid YAML"),
        ("a: !!int\n", "cannot read ''"),  # PyYAML: IndexError
        ("a: !!float ''\n", "cannot read ''"),
        ("model: {num_layers: [\n", "not valid YAML at line 2"),
        ("- 1\n- 2\n", "must hold a mapping (key: value), got a list"),
        ("a: 1\n---\nb: 2\n", "holds 2 YAML documents"),
    ],
)
def test_malformed_content_is_one_line(tmp_path: Path, text: str, needle: str) -> None:
    assert needle in _refusal(tmp_path / "run.yaml", text)


def test_a_repeated_key_is_refused_where_it_stands_and_a_merge_may_still_be_overridden(
    tmp_path: Path, gaudi3_cli: Any
) -> None:
    """PyYAML keeps the last of a repeated key: a second `model:` section would drop the first's model.name."""
    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  name: llama-tiny\n  num_layers: 1\ntrain:\n  max_steps: 4\nmodel:\n  dropout: 0.1\n"
    )
    code, out, err = gaudi3_cli("train", "--config", str(config), "--print-config")
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [
        f"gaudi3: error: config file {str(config)!r}: key 'model' appears twice (lines 1 and 6); keep one"
    ]
    assert _refusal(config, "train: {max_steps: 4, max_steps: 8}\n").endswith(
        "key 'max_steps' appears twice (line 1, columns 9 and 23); keep one"
    )
    with pytest.raises(ConfigError, match="key 'a' appears twice"):
        parse_yaml_value("{a: 1, a: 2}", field="data.mixture")
    merged = "base: &b {x: 1, y: 2}\nm:\n  <<: *b\n  x: 3\n"  # YAML's merge key: an override, not a repeat
    assert parse_yaml(merged, where="m") == {"base": {"x": 1, "y": 2}, "m": {"x": 3, "y": 2}}
    # a merge source that overrides a merge of its own, merged by a shallower mapping (flattened before it is built)
    nested = "defs:\n  base: &b {lr: 1}\n  mid: &m\n    <<: *b\n    lr: 2\ntop:\n  <<: *m\n  steps: 5\n"
    assert parse_yaml(nested, where="n")["top"] == {"lr": 2, "steps": 5}
    with pytest.raises(UserInputError, match=r"key 'a' appears twice \(line 2, columns 11 and 17\)"):
        parse_yaml("top:\n  <<: &m {a: 1, a: 2}\n  b: 3\n", where="i")  # a repeat inside a merge source


def test_an_empty_file_is_an_empty_mapping(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("# nothing yet\n")
    assert load_yaml_file(path) == {}


def test_multi_document_streams_have_the_same_limits() -> None:
    assert parse_yaml_documents("a: 1\n---\nb: 2\n", where="m") == [{"a": 1}, {"b": 2}]
    with pytest.raises(UserInputError, match="alias bomb"):
        parse_yaml_documents("kind: x\n---\n" + alias_bomb(), where="m")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[" * 100_000, f"nested deeper than {MAX_DEPTH} levels"),  # the C decoder's RecursionError
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH} levels"),
        ('{"a": ' + "9" * 5000 + "}", "an integer of 5,000 characters"),
        ('{"a": 1', "not valid JSON at line 1, column 8"),
        ("[1, 2]", "must hold a mapping"),
    ],
)
def test_json_has_the_same_limits(text: str, needle: str) -> None:
    with pytest.raises(UserInputError) as info:
        parse_json(text, where="result.json")
    assert str(info.value).startswith("result.json") and needle in str(info.value)


def test_json_files_are_read_as_utf8(tmp_path: Path) -> None:
    path = tmp_path / "model_config.json"
    path.write_bytes(b'{"name": "\xe9"}')
    with pytest.raises(UserInputError, match=r"model config '.*' is not UTF-8 text: byte 0xe9 at offset 10"):
        load_json_file(path, what="model config")
    path.write_text(json.dumps({"name": "é"}))
    assert load_json_file(path, what="model config") == {"name": "é"}


@pytest.mark.parametrize("text", ["a: b: c", "[1, 2", "2020-13-45", "x\ty", "'"])
def test_a_command_line_value_that_is_not_yaml_stays_text(text: str) -> None:
    assert parse_yaml_value(text, field="data.source") == text


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("9" * 5000, "an integer of 5,000 characters"),
        ("{a: " * 200, "nested deeper than"),
        ("[" * 5000, "nested deeper than"),
        ("&a [*a]", "refers to a node that contains it"),
        ("[" + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}" if i else "x"] * 10) + "]" for i in range(8)) + "]",
         "alias bomb"),
    ],
)  # fmt: skip
def test_a_command_line_value_over_a_limit_names_the_field(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_yaml_value(text, field="seed")
    assert info.value.field == "seed" and needle in str(info.value) and len(str(info.value)) < 200


def test_blank_command_line_values_keep_their_meaning() -> None:
    assert parse_yaml_value("", field="out_dir") == ""  # an empty text field
    assert parse_yaml_value(" ", field="out_dir") is None  # YAML: null, as before the limits
    assert parse_yaml_value("3", field="x") == 3 and parse_yaml_value("true", field="x") is True


_PIECES = [*"[]{}:,-?&*!|>'\"%@`#\n \t0123456789abc.e+_x<", "!!int ", "!!float ", "!!timestamp ", "!!binary ",
           "!!set ", "!!omap ", "!!pairs ", "<<: ", "&a ", "*a", "---\n", "2020-13-45", "\x00", "\ufeff", "0x", "1:2"]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(text=st.lists(st.sampled_from(_PIECES), max_size=40).map("".join))
def test_fuzzed_yaml_and_json_raise_nothing_but_one_line_user_errors(text: str) -> None:
    """20,000 examples of this found PyYAML's IndexError on an empty `!!int`; 150 keep it from coming back."""
    for parse in (
        lambda: parse_yaml(text, where="w", expect=None),
        lambda: parse_json(text, where="w", expect=None),
        lambda: parse_yaml_value(text, field="f"),
    ):
        try:
            parse()
        except UserInputError as exc:
            assert "\n" not in str(exc) and len(str(exc)) < 300
