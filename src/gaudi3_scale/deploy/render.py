"""The renderer registry and the one function that writes rendered files.

A renderer takes a `DeploySpec` and returns {relative path: file text}; `register_renderer` adds one per target
(plain registry, filled by the target modules when `renderers()` first imports them), with the dataclass its
`--set KEY=VALUE` options are read into when it takes any (`target_options`; the options reference page is made
from them). `write_files` never
overwrites a file that differs unless told to, so a user's edits to a rendered tree are not lost silently.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import check_output_dir
from gaudi3_scale.deploy.spec import DeploySpec

__all__ = [
    "CONTAINERS",
    "RECORD_DIR",
    "Renderer",
    "register_renderer",
    "render",
    "renderers",
    "target_options",
    "write_files",
]

Renderer = Callable[[DeploySpec], dict[str, str]]
_RENDERERS: dict[str, Renderer] = {}
_OPTIONS: dict[str, type] = {}  # target: the dataclass of its `DeploySpec.extra` (--set KEY=VALUE)
# The modules that register renderers, imported on first use (each needs only the standard library and yaml).
_MODULES = (
    "gaudi3_scale.deploy.kubernetes",
    "gaudi3_scale.deploy.terraform",
    "gaudi3_scale.deploy.onprem",
    "gaudi3_scale.deploy.containers",
    "gaudi3_scale.deploy.ci",
)
CONTAINERS = "containers"  # not a target: the image files every target's nodes run, rendered with each target


def register_renderer(target: str, renderer: Renderer, *, options: type | None = None) -> None:
    """`options`: the dataclass the target reads `DeploySpec.extra` into; a target without one refuses --set."""
    if target in _RENDERERS:
        raise ValueError(f"a renderer for {target!r} is registered already")
    _RENDERERS[target] = renderer
    if options is not None:
        _OPTIONS[target] = options


def renderers() -> dict[str, Renderer]:
    for module in _MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return dict(_RENDERERS)


def target_options() -> dict[str, type]:
    """The targets that take --set KEY=VALUE, each with the dataclass of its options."""
    renderers()
    return dict(_OPTIONS)


def render(spec: DeploySpec) -> dict[str, str]:
    """Every file of `spec`'s target: the target's own files plus the container files all targets ship."""
    found = renderers()
    if spec.target not in found:
        available = ", ".join(sorted(set(found) - {CONTAINERS}))
        raise UserInputError(f"--target {spec.target}: no renderer yet; available: {available}")
    if spec.extra and spec.target not in _OPTIONS:
        raise UserInputError(
            f"--set: --target {spec.target} takes no options (only {', '.join(sorted(_OPTIONS))} take them); "
            "its settings are Terraform / Ansible variables in the rendered files"
        )
    # Each target checks the run config with its nodes' own command (`node_command.check_node_config`).
    files = dict(found[spec.target](spec))
    if CONTAINERS in found:
        files.update(found[CONTAINERS](spec))
    return files


RECORD_DIR = ".gaudi3-render"  # under --out: <target>.files, the files each target's last render wrote


def write_files(
    files: Mapping[str, str], out_dir: Path, *, force: bool = False, record: str | None = None
) -> tuple[list[Path], list[Path]]:
    """Write `files` under `out_dir` (each atomically); returns (written, removed). A file that exists with other
    content is refused (one line naming it) unless `force`; identical files are left alone. Everything that would
    stop a write (a file where a directory goes, a directory where a file goes, a link out of `out_dir`) is refused
    before any file is written.

    `record` (a target): the rendered paths are listed in RECORD_DIR/<record>.files, and the files that list named
    before which this render no longer produces (a re-render with other options: a PVC manifest after
    storage=emptydir) are removed, with `force`, so that `kubectl apply -f k8s/base/` applies no stale object.
    Only files a render wrote are ever removed, and none another target's list names (they share docker/)."""
    check_output_dir("--out", out_dir)
    root = out_dir.resolve()
    stale: list[Path] = []
    if record is not None:
        stale = _stale(root, record, set(files))
        files = {**files, f"{RECORD_DIR}/{record}.files": "".join(f"{rel}\n" for rel in sorted(files))}
    targets = {}
    for rel, text in files.items():
        path = (root / rel).resolve()
        if root not in path.parents:
            raise UserInputError(f"--out: {rel} would be written through a link out of {str(out_dir)!r}")
        check_output_dir("--out", path.parent)
        if path.exists() and not path.is_file():
            raise UserInputError(
                f"--out: {str(path)!r} is in the way of a rendered file (not a regular file)"
            )
        targets[path] = text.encode()
    clashes = [p for p, data in targets.items() if p.exists() and p.read_bytes() != data
               and p.parent.name != RECORD_DIR]  # fmt: skip
    if stale and not force:
        raise UserInputError(
            f"{stale[0]} was rendered before and would not be now ({len(stale)} such file(s)); render into a new "
            "--out directory, or pass --force to remove them"
        )
    if clashes and not force:
        raise UserInputError(
            f"{clashes[0]} exists and differs from what would be rendered ({len(clashes)} such file(s)); "
            "render into a new --out directory, or pass --force to overwrite"
        )
    written = []
    try:
        for path, data in sorted(targets.items()):
            if path.exists() and path.read_bytes() == data:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
            if path.parent.name != RECORD_DIR:  # the list itself is not a rendered file
                written.append(path)
        for path in stale:
            path.unlink()
            _remove_empty_parents(path.parent, root)
    except OSError as exc:  # the file system refused (read-only, /proc, full): one line, naming the path
        raise UserInputError(
            f"--out: cannot write {exc.filename or out_dir} ({exc.strerror or exc})"
        ) from None
    return written, stale


def _recorded(path: Path) -> set[str]:
    return set(path.read_text(encoding="utf-8").splitlines()) if path.is_file() else set()


def _stale(root: Path, record: str, rendered: set[str]) -> list[Path]:
    """The files `record`'s previous render wrote under `root` that `rendered` does not hold, nor another target's
    list: each a regular file inside `root` (a list edited to name anything else is ignored there)."""
    lists = root / RECORD_DIR
    others: set[str] = set()
    if lists.is_dir():
        for other in lists.glob("*.files"):
            if other.name != f"{record}.files":
                others |= _recorded(other)
    stale = []
    for rel in sorted(_recorded(lists / f"{record}.files") - rendered - others):
        path = root / rel
        inside = rel and not Path(rel).is_absolute() and root in path.resolve().parents
        if inside and path.is_file() and not path.is_symlink():
            stale.append(path)
    return stale


def _remove_empty_parents(directory: Path, root: Path) -> None:
    """Remove `directory` and its parents up to `root` while they are empty (k8s/monitoring/ once its files went)."""
    while directory != root and root in directory.parents and not any(directory.iterdir()):
        directory.rmdir()
        directory = directory.parent
