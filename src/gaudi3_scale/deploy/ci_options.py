"""The CI target's options (`DeploySpec.extra`, `--set KEY=VALUE`): registry, image, platforms, runners, Python.

Built with the config module's `from_dict` (as `k8s_options` is), so an unknown key is one line naming `ci.<key>`
and the allowed ones. Every value is written into the workflow, where GitHub evaluates `${{ … }}` before any
shell sees it: each field is held to a grammar without `$`, `{`, quotes, spaces or backslashes, so no value can
become an expression or shell syntax there (shell words are quoted too, `deploy/quoting.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gaudi3_scale.config.core import from_dict
from gaudi3_scale.config.errors import ConfigError, brief
from gaudi3_scale.deploy.grammar import check_image, matches
from gaudi3_scale.deploy.spec import DeploySpec

__all__ = ["DEFAULT_REGISTRY", "PLATFORMS", "CiOptions", "ci_options", "runner_labels"]

DEFAULT_REGISTRY = (
    "ghcr.io"  # GITHUB_TOKEN can push there (with `packages: write`); other registries need a secret
)
# The platforms PyPI publishes Linux torch wheels for (manylinux x86_64 and aarch64): the image installs torch
# from PyPI on NVIDIA, so another platform would fail at `pip install`.
PLATFORMS = ("linux/amd64", "linux/arm64")
_LABEL = "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # a runner label: no spaces, commas or `${{`
_PATH = (
    "[A-Za-z0-9_][A-Za-z0-9_.-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.-]*)*"  # relative, no leading dot (so no `..`)
)
_SECRET = "[A-Za-z_][A-Za-z0-9_]{0,99}"  # GitHub's secret names; GITHUB_* is reserved (checked below)
_USERNAME = "[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}"
_BRANCH = "[A-Za-z0-9_][A-Za-z0-9_./-]{0,99}"
_PYTHON = "3[.](?:1[1-9]|[2-9][0-9])"  # the package needs Python >= 3.11 (pyproject.toml requires-python)
_OVERRIDE = "[a-z_][a-z0-9_]*(?:[.][a-z_][a-z0-9_]*)+=[A-Za-z0-9_.:/,+-]*"  # section.field=value


@dataclass(frozen=True, kw_only=True)
class CiOptions:
    """The GitHub Actions workflow's registry, image, platforms, runners and Python; each value is held to a grammar
    without `$`, `{`, quotes, spaces or backslashes."""

    registry: str = field(
        default=DEFAULT_REGISTRY, metadata={"help": "registry host the image is pushed to (host[:port])"}
    )
    image_name: str | None = field(
        default=None,
        metadata={
            "help": "repository path in the registry (team/train); null = the GitHub repository, lower-cased"
        },
    )
    registry_username: str | None = field(
        default=None,
        metadata={"help": "user name for the registry login; null = the actor who ran the workflow"},
    )
    registry_password_secret: str | None = field(
        default=None,
        metadata={
            "help": "name of the repository secret holding the registry password or token; null = GITHUB_TOKEN "
            "(ghcr.io only). Referenced by name: no credential is ever written into the workflow"
        },
    )
    platforms: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated image platforms; null = linux/amd64,linux/arm64 (NVIDIA) or linux/amd64 "
            "(Gaudi: an arm64 variant of Intel's base image is not known to this project)"
        },
    )
    # `--set python_version=3.12` arrives as a YAML number: kept as its text (3.20 reads as 3.2: quote it).
    python_version: str | float = field(
        default="3.11", metadata={"help": "Python of the lint, unit and test tiers (3.X, X >= 11)"}
    )
    source: str = field(
        default=".",
        metadata={
            "help": "the gaudi3-scale source tree in the repository (pyproject.toml, requirements/, src/): the image's "
            "build context and what the tiers install; e.g. third_party/gaudi3-scale for a submodule"
        },
    )
    requirements: str | None = field(
        default=None,
        metadata={"help": "the repository's own requirements file for the unit tier; null = none"},
    )
    smoke_runs_on: str | None = field(
        default=None,
        metadata={"help": "comma-separated runner labels of the smoke tier (a self-hosted GPU or Gaudi runner); "
                  "null = ubuntu-latest (CPU)"},
    )  # fmt: skip
    repro_runs_on: str | None = field(
        default=None,
        metadata={"help": "comma-separated runner labels of the repro tier; null = ubuntu-latest (CPU)"},
    )
    repro_steps: int = field(
        default=20, metadata={"help": "optimizer steps of each repro run (resume mode: at least 2)"}
    )
    repro_overrides: list[str] = field(
        default_factory=list,
        metadata={
            "help": "config overrides for the repro runs, section.field=value (e.g. [model.num_layers=2])"
        },
    )
    branch: str = field(
        default="main", metadata={"help": "pushes to this branch (and v* tags) publish the image"}
    )

    def __post_init__(self) -> None:
        _check_registry(self.registry)
        if self.image_name is not None:
            check_image(f"{self.registry}/{self.image_name}", "image_name")
            if ":" in self.image_name or "@" in self.image_name:
                raise ConfigError(
                    "image_name", f"a repository path without tag or digest, got {brief(self.image_name)}"
                )
        _check("registry_username", self.registry_username, _USERNAME, "a user name (letters, digits, ._@+-)")
        _check(
            "registry_password_secret", self.registry_password_secret, _SECRET, "a secret name (A-Z, 0-9, _)"
        )
        if (self.registry_password_secret or "").upper().startswith("GITHUB_"):
            raise ConfigError("registry_password_secret", "GITHUB_* names are reserved; null = GITHUB_TOKEN")
        if self.registry_password_secret is None and self.registry != DEFAULT_REGISTRY:
            raise ConfigError(
                "registry_password_secret",
                f"GITHUB_TOKEN logs in to {DEFAULT_REGISTRY} only; name the secret that holds {self.registry}'s token",
            )
        for platform in _split(self.platforms or ""):
            if platform not in PLATFORMS:
                raise ConfigError("platforms", f"got {brief(platform)}; allowed: {', '.join(PLATFORMS)}")
        if self.platforms is not None and not _split(self.platforms):
            raise ConfigError("platforms", f"at least one of {', '.join(PLATFORMS)}")
        python_version = str(self.python_version)
        object.__setattr__(self, "python_version", python_version)
        _check("python_version", python_version, _PYTHON, "3.X with X >= 11 (the package needs >= 3.11)")
        if self.source != ".":
            _check("source", self.source, _PATH, "'.' or a relative path inside the repository")
        _check("requirements", self.requirements, _PATH, "a relative path inside the repository")
        for name in ("smoke_runs_on", "repro_runs_on"):
            value = getattr(self, name)
            if value is not None and not (_split(value) and all(matches(_LABEL, v) for v in _split(value))):
                raise ConfigError(
                    name, f"comma-separated runner labels (letters, digits, ._-), got {brief(value)}"
                )
        if self.repro_steps < 2:
            raise ConfigError("repro_steps", f"resume mode needs at least 2 steps, got {self.repro_steps}")
        for i, override in enumerate(self.repro_overrides):
            _check(
                f"repro_overrides[{i}]",
                override,
                _OVERRIDE,
                "section.field=value (value: letters, digits, _.:/,+-)",
            )
        _check("branch", self.branch, _BRANCH, "a branch name (letters, digits, _./-)")
        if ".." in self.branch or self.branch.endswith(("/", ".")):
            raise ConfigError("branch", f"not a valid git branch name: {brief(self.branch)}")


def ci_options(spec: DeploySpec) -> CiOptions:
    return from_dict(CiOptions, spec.extra, prefix="ci")


def runner_labels(value: str | None) -> str | list[str]:
    """`runs-on` of a tier: GitHub's hosted Ubuntu runner, or every label given (a runner must carry all)."""
    return _split(value) if value else "ubuntu-latest"


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _check(name: str, value: str | None, pattern: str, allowed: str) -> None:
    if value is not None and not matches(pattern, value):
        raise ConfigError(name, f"must be {allowed}, got {brief(value)}")


def _check_registry(value: str) -> None:
    # A reference's first component names a registry only with a '.' or ':' in it, or as `localhost`
    # (github.com/distribution/reference, normalize.go); anything else would be read as a Docker Hub path.
    host_like = isinstance(value, str) and ("." in value or ":" in value or value == "localhost")
    if not host_like or "/" in value or not re.fullmatch(r"[A-Za-z0-9.:\[\]-]+", value):
        raise ConfigError(
            "registry",
            f"must be a registry host such as ghcr.io or registry.example.com:5000, got {brief(value)}",
        )
    check_image(f"{value}/x", "registry")
