"""`gaudi3 deploy plan|apply|destroy PATH…`: hand rendered files to terraform or kubectl.

The files decide the tool. A directory with `*.tf` files (PATH itself, or one of its subdirectories) → terraform,
run in that directory. Kubernetes manifests (YAML documents with `apiVersion` and `kind`; files, or directories
searched recursively) → kubectl, every file passed with `-f`; a directory with a `kustomization.yaml` → `-k`. Two
files defining the same job (the render's PyTorchJob and indexed-Job flavours) are alternatives and refused: pass
the ones to use, e.g. `gaudi3 deploy apply out/k8s/base out/k8s/pytorchjob.yaml`.

`plan` with kubectl is a server-side dry run plus `kubectl diff`: before the first apply it reports the namespace
missing (the server cannot dry-run objects into a namespace that does not exist yet).

Nothing changes without consent: `plan` runs read-only commands only; `apply` and `destroy` print every command and
run the changing ones only with `--yes`, or after a yes at an interactive prompt. This module writes no files and no
credentials: terraform and kubectl find those where they always do (environment, AWS_PROFILE, KUBECONFIG, …).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import parse_yaml_documents, read_text_file

__all__ = [
    "ACTIONS",
    "Command",
    "Commands",
    "ConsentRequired",
    "Deployment",
    "ToolFailed",
    "commands_for",
    "execute",
    "find_deployment",
    "require_tool",
]

ACTIONS = ("plan", "apply", "destroy")
INSTALL_DOCS = {
    "terraform": "https://developer.hashicorp.com/terraform/install",
    "kubectl": "https://kubernetes.io/docs/tasks/tools/",
}
KUSTOMIZATION = ("kustomization.yaml", "kustomization.yml", "Kustomization")
# Kinds that run the training: two files defining one of these under the same name are alternatives.
WORKLOAD_KINDS = frozenset({"Job", "PyTorchJob", "TrainJob", "JobSet", "MPIJob"})


class ToolFailed(Exception):
    """terraform / kubectl exited with an error (its own output says why)."""

    def __init__(self, command: str, returncode: int) -> None:
        super().__init__(f"`{command}` failed with exit code {returncode}")
        self.returncode = returncode


class ConsentRequired(UserInputError):
    """apply / destroy without --yes where nobody can be asked."""


@dataclass(frozen=True, kw_only=True)
class Deployment:
    tool: str  # terraform or kubectl
    directory: Path  # where the commands run
    manifests: tuple[str, ...] = ()  # kubectl: the manifest files, relative to `directory`
    kustomize: bool = False  # kubectl: the directory is a kustomization


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    # exit codes that are not failures: `kubectl diff` exits 1 when there are changes
    ok_exit_codes: frozenset[int] = field(default=frozenset({0}))

    def __str__(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True, kw_only=True)
class Commands:
    setup: tuple[Command, ...] = ()  # prerequisites that change no infrastructure (terraform init)
    preview: tuple[Command, ...] = ()  # read-only: what would change
    change: tuple[Command, ...] = ()  # changes infrastructure: needs --yes or a confirmation

    @property
    def all(self) -> tuple[Command, ...]:
        return self.setup + self.preview + self.change


def _manifest_docs(path: Path) -> list[dict[str, Any]] | None:
    """The documents of a Kubernetes manifest file; None for other YAML (configs, Ansible)."""
    text = read_text_file(path, what="manifest")  # UTF-8 and size limits: one line naming the file
    try:
        docs = [d for d in parse_yaml_documents(text, where=str(path)) if d is not None]
    except UserInputError as exc:
        if "apiVersion" in text:
            raise UserInputError(f"looks like a Kubernetes manifest, but {exc}") from None
        return None  # some other YAML-ish file (e.g. an Ansible template): not ours to judge
    if docs and all(isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in docs):
        return docs
    return None


def _yaml_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    found = [*path.rglob("*.yaml"), *path.rglob("*.yml")]
    return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(path).parts))


def _check_alternatives(manifests: dict[Path, list[dict[str, Any]]]) -> None:
    """Refuse two files that define the same job twice (the render's PyTorchJob and indexed-Job flavours)."""
    seen: dict[tuple[str, str], Path] = {}
    for path, docs in manifests.items():
        for doc in docs:
            if doc.get("kind") not in WORKLOAD_KINDS:
                continue
            meta = doc.get("metadata") or {}
            key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
            if key in seen and seen[key] != path:
                base = [str(path.parent / "base")] if (path.parent / "base").is_dir() else []
                example = " ".join([*base, str(seen[key])])
                raise UserInputError(
                    f"{seen[key]} and {path} both define job {key[1]!r} (alternatives: pick one); pass the "
                    f"files to use, e.g. `gaudi3 deploy plan {example}`"
                )
            seen[key] = path


def _kubectl_deployment(paths: Sequence[Path]) -> Deployment | None:
    if len(paths) == 1 and paths[0].is_dir() and any((paths[0] / n).is_file() for n in KUSTOMIZATION):
        return Deployment(tool="kubectl", directory=paths[0], kustomize=True)
    manifests: dict[Path, list[dict[str, Any]]] = {}
    for path in paths:
        for file in _yaml_files(path):
            docs = _manifest_docs(file)
            if docs is not None:
                manifests[file.resolve()] = docs
    if not manifests:
        return None
    _check_alternatives(manifests)
    root = Path(os.path.commonpath([p.parent for p in manifests]))
    return Deployment(
        tool="kubectl", directory=root, manifests=tuple(str(p.relative_to(root)) for p in manifests)
    )


def find_deployment(paths: Sequence[Path]) -> Deployment:
    """The deployment in `paths`: one directory with *.tf files (itself or one subdirectory) for terraform, or
    Kubernetes manifests (files, or directories searched recursively) for kubectl."""
    for path in paths:
        if not path.exists():
            raise UserInputError(
                f"{path}: no such file or directory (render one with `gaudi3 deploy render`)"
            )
    if len(paths) == 1 and paths[0].is_dir():
        directory = paths[0]
        if any(directory.glob("*.tf")):
            return Deployment(tool="terraform", directory=directory)
        below = [d for d in sorted(directory.iterdir()) if d.is_dir() and not d.name.startswith(".")]
        terraform = [d for d in below if any(d.glob("*.tf"))]
        kubectl = _kubectl_deployment(paths)
        found = [Deployment(tool="terraform", directory=d) for d in terraform] + (
            [kubectl] if kubectl else []
        )
        if len(found) > 1:
            names = ", ".join(str(d.directory) for d in found)
            raise UserInputError(f"{directory} holds several deployments ({names}); pass one of them")
        if found:
            return found[0]
        raise UserInputError(
            f"{directory}: no Terraform (*.tf) or Kubernetes manifests (YAML with apiVersion and kind) in it or "
            "its subdirectories (onprem renders run with ansible-playbook; see their README)"
        )
    if any(p.suffix == ".tf" for p in paths):
        raise UserInputError("terraform works on a directory: pass the one holding the *.tf files, alone")
    kubectl = _kubectl_deployment(paths)
    if kubectl is None:
        raise UserInputError(
            f"no Kubernetes manifests (YAML with apiVersion and kind) in {', '.join(map(str, paths))}"
        )
    return kubectl


def require_tool(tool: str, deployment: Deployment, action: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise UserInputError(
            f"{tool} is not installed: it is needed to {action} {deployment.directory}; install it "
            f"({INSTALL_DOCS[tool]}) and put it on PATH"
        )
    return path


def _terraform(action: str) -> Commands:
    init = Command(("terraform", "init", "-input=false"))
    if action == "plan":
        return Commands(setup=(init,), preview=(Command(("terraform", "plan", "-input=false")),))
    if action == "apply":
        return Commands(
            setup=(init,),
            preview=(Command(("terraform", "plan", "-input=false")),),
            change=(Command(("terraform", "apply", "-input=false", "-auto-approve")),),
        )
    return Commands(
        setup=(init,),
        preview=(Command(("terraform", "plan", "-destroy", "-input=false")),),
        change=(Command(("terraform", "destroy", "-input=false", "-auto-approve")),),
    )


def _kubectl(action: str, deployment: Deployment) -> Commands:
    files = ("-k", ".") if deployment.kustomize else tuple(a for m in deployment.manifests for a in ("-f", m))
    dry_apply = Command(("kubectl", "apply", "--dry-run=server", *files))
    diff = Command(("kubectl", "diff", *files), ok_exit_codes=frozenset({0, 1}))  # 1: there are differences
    if action == "plan":
        return Commands(preview=(dry_apply, diff))
    if action == "apply":
        # The server-side dry run and diff fail for objects in a namespace the same apply creates (kubectl cannot
        # dry-run the namespace into existence), so a first apply previews on the client: the manifests must parse
        # and their kinds be known to the cluster (a missing CRD such as PyTorchJob stops it here).
        client = Command(("kubectl", "apply", "--dry-run=client", *files))
        return Commands(preview=(client,), change=(Command(("kubectl", "apply", *files)),))
    delete = ("kubectl", "delete", "--ignore-not-found")
    return Commands(
        preview=(Command((*delete, "--dry-run=server", *files)),), change=(Command((*delete, *files)),)
    )


def commands_for(deployment: Deployment, action: str) -> Commands:
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}; expected one of {', '.join(ACTIONS)}")
    return _terraform(action) if deployment.tool == "terraform" else _kubectl(action, deployment)


def _run(commands: tuple[Command, ...], directory: Path, echo: Callable[[str], None]) -> None:
    for command in commands:
        echo(f"$ {command}")
        returncode = subprocess.run(list(command.argv), cwd=directory).returncode
        if returncode not in command.ok_exit_codes:
            raise ToolFailed(str(command), returncode)


def execute(
    deployment: Deployment,
    action: str,
    *,
    yes: bool,
    confirm: Callable[[str], bool] | None,
    echo: Callable[[str], None],
) -> bool:
    """Run `action` on `deployment`; False when the user declined at the prompt.

    `confirm` asks a yes/no question (None: nobody to ask, so apply / destroy without `yes` print the commands and
    raise ConsentRequired without running any).
    """
    require_tool(deployment.tool, deployment, action)
    commands = commands_for(deployment, action)
    echo(f"{action} {deployment.directory} with {deployment.tool}:")
    if commands.change and not yes and confirm is None:
        for command in commands.all:
            echo(f"  would run: {command}")
        raise ConsentRequired(
            f"{action} changes infrastructure: pass --yes to run the commands above in {deployment.directory}"
        )
    _run(commands.setup + commands.preview, deployment.directory, echo)
    if not commands.change:
        return True
    if not yes:
        assert confirm is not None
        if not confirm(f"{action}: run {'; '.join(map(str, commands.change))}?"):
            echo(f"{action} cancelled; nothing was changed")
            return False
    _run(commands.change, deployment.directory, echo)
    return True
