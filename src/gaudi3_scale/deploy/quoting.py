"""The one escaping layer: every value a renderer writes into a file goes through the function for that file's
language, so that it can only ever be data there, never code.

    shell            sh_quote, sh_heredoc         (bash / POSIX sh: a single-quoted word; a quoted heredoc)
    HCL              hcl_string                   (a quoted string literal, template sequences taken literally)
    Terraform tftpl  tftpl_literal                (text of a templatefile() template, taken literally)
    YAML             yaml_text                    (the safe dumper, never string concatenation)
    Dockerfile       dockerfile_exec              (the JSON exec form of RUN / CMD / ENTRYPOINT / HEALTHCHECK)
    Kubernetes       k8s_literal                  (command, args and env values, where `$(VAR)` expands)
    comments         comment                      (one line after `#`, in every language above)

The values are checked against their field's grammar first (`deploy/grammar.py`); this layer must hold even for a
value that slipped past a grammar, so it is tested with arbitrary text.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable
from typing import Any

import yaml

__all__ = [
    "comment",
    "dockerfile_exec",
    "hcl_string",
    "k8s_literal",
    "sh_heredoc",
    "sh_quote",
    "tftpl_literal",
    "yaml_text",
]


def sh_quote(value: str) -> str:
    """One shell word that is exactly `value`: no expansion, globbing or splitting (bare when nothing needs it)."""
    if "\0" in value:
        raise ValueError("a shell word cannot hold a NUL character")
    return shlex.quote(value)


def sh_heredoc(command: str, text: str, *, delimiter: str = "GAUDI3_EOF") -> str:
    """`command <<'DELIMITER'` feeding `text` to it verbatim (a quoted delimiter: no expansion inside). The
    delimiter gets a numeric suffix until no line of `text` equals it, so the text cannot end the heredoc early."""
    if not text.endswith("\n"):
        raise ValueError("heredoc text must end with a newline")
    lines = set(text.split("\n"))
    chosen, n = delimiter, 0
    while chosen in lines:
        n += 1
        chosen = f"{delimiter}_{n}"
    return f"{command} <<'{chosen}'\n{text}{chosen}\n"


# HCL's quoted-string escapes (hclsyntax spec, "Template Literals"); anything else unprintable becomes \uNNNN.
_HCL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def hcl_string(value: str) -> str:
    """A quoted HCL string literal that evaluates to exactly `value` (`${` and `%{` taken literally)."""
    out = []
    for char in value:
        if char in _HCL_ESCAPES:
            out.append(_HCL_ESCAPES[char])
        elif not char.isprintable():
            code = ord(char)
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(char)
    return '"' + tftpl_literal("".join(out)) + '"'


def tftpl_literal(text: str) -> str:
    """`text` inside a Terraform template (or HCL string), taken literally: `${` and `%{` escaped as `$${` / `%%{`
    (so bash's own `${x}` stays bash's)."""
    return text.replace("${", "$${").replace("%{", "%%{")


def k8s_literal(value: str) -> str:
    """`value` in a container's command, args or env value, where Kubernetes expands `$(VAR)` and reads `$$` as
    one `$` (Kubernetes API reference, Container.args): every `$` doubled, so nothing expands."""
    return value.replace("$", "$$")


def dockerfile_exec(argv: Iterable[str]) -> str:
    """The JSON-array (exec) form of a Dockerfile instruction's command: no shell, one line whatever the values."""
    return json.dumps(list(argv), ensure_ascii=False)


def comment(text: str) -> str:
    """`text` made safe to follow `#` on one line: every character that is not printable (newlines, carriage
    returns, YAML's other line breaks U+0085 / U+2028 / U+2029, control characters) written as an escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


# Plain scalars that PyYAML reads as strings but YAML 1.1 readers elsewhere (Go's yaml.v2, behind kubectl and
# sigs.k8s.io/yaml) read as booleans or numbers: `y`, `n`, `1e3`, `0o17`. Written quoted, they stay strings.
_TYPED_ELSEWHERE = re.compile(
    r"[yYnN]|[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?0o[0-7_]+", re.ASCII
)


class _Dumper(yaml.SafeDumper):
    """yaml.safe_dump's dumper with block style for multi-line strings (a run config inside a ConfigMap reads as
    YAML, not one escaped line), no anchors (each document written out in full), and the quoting above."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else "'" if _TYPED_ELSEWHERE.fullmatch(value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def yaml_text(data: Any) -> str:
    """One YAML document holding `data` (keys in their order)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)
