"""How the consumers of rendered deployment files read them, re-stated for the deploy tests (tests/unit/test_deploy_*):
Terraform's templatefile() on the node bootstrap, RE2's whole-text match (Terraform's regex()), and Go's yaml.v2
(kubectl, sigs.k8s.io/yaml), which reads more plain scalars as booleans and numbers than PyYAML does."""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["SECRETS_LOOP", "GoYamlLikeLoader", "re2_fullmatch", "templatefile"]

SECRETS_LOOP = "%{ for env_name, ref in secrets ~}\n${env_name}=${ref}\n%{ endfor ~}\n"
_NOT_ESCAPED = re.compile(r"(?<!\$)\$\{|(?<!%)%\{")


def templatefile(text: str, values: dict[str, Any]) -> str:
    """What Terraform's templatefile() makes of the bootstrap: its one for-loop, `${name}` interpolations, and the
    `$${` / `%%{` escapes. Anything else in template syntax fails here (Terraform would need to evaluate it)."""
    text = text.replace(SECRETS_LOOP, "".join(f"{k}={v}\n" for k, v in sorted(values["secrets"].items())))
    text = re.sub(r"(?<!\$)\$\{([a-z_]+)\}", lambda m: str(values[m.group(1)]), text)
    assert not _NOT_ESCAPED.search(text), _NOT_ESCAPED.search(text)
    return text.replace("$${", "${").replace("%%{", "%{")


def re2_fullmatch(anchored: str, value: str) -> bool:
    """RE2's `^…$` (Terraform's regex()): `$` is the end of the text only, not also before a final newline as in
    Python's `re`; the grammars use no syntax the two engines read differently otherwise."""
    assert anchored.startswith("^") and anchored.endswith("$"), anchored
    return re.search(anchored[:-1] + r"\Z", value, re.ASCII) is not None


class GoYamlLikeLoader(yaml.SafeLoader):
    """PyYAML plus the plain scalars Go's yaml.v2 also reads as booleans or numbers: y / n, 1e3, 0o17."""


GoYamlLikeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))
GoYamlLikeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)
GoYamlLikeLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?0o[0-7_]+$"), list("-+0"))
