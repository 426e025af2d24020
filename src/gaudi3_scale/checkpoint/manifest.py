"""The commit record of a checkpoint directory: every file with its size and SHA-256, written last.

A checkpoint is a directory (`step-XXXXXXXX/`). It counts as committed only once `manifest.json` is in it; the
manifest is written to a temporary name, flushed to disk and renamed, so it is either whole or absent. Loading
verifies every listed file against its size and checksum first.

A manifest whose JSON parses but does not have the shape written here (`parse_manifest`: a `files` mapping of safe
relative names to `{size_bytes, sha256}`, typed metadata) counts as damaged, exactly like a flipped byte in a payload
file: `verify_checkpoint` names the problem, a resume skips the checkpoint, an explicit path is refused.

SHA-256 (hashlib, OpenSSL): a cryptographic hash, so a flipped byte anywhere is caught, at 1-2 GB/s per core with
the SHA extensions that current x86 and Arm server CPUs have. Hashing is what a resume spends its time on, and the
launcher and every rank it starts verify the same checkpoint: a rank does not hash again what the launcher that
started it verified (`hand_down_verified`) within `VERIFIED_TRUST_S`, while no listed file has changed (size,
mtime, ctime, inode). Bytes that rot on disk keep their times, so an older verification is not trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import stat
import time
from pathlib import Path, PurePosixPath
from typing import Any

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.config.files import decode_utf8, parse_json

__all__ = [
    "DCP_INDEX_NAME",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SHARDED_META_NAME",
    "STATE_NAME",
    "ManifestError",
    "file_sha256",
    "fsync_directory",
    "hand_down_verified",
    "has_manifest",
    "library_versions",
    "manifest_layout",
    "manifest_problem",
    "parse_manifest",
    "read_manifest",
    "read_pointer",
    "verify_checkpoint",
    "write_manifest",
]

FORMAT = "gaudi3-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync_directory(directory: Path) -> None:
    """Make renames and new entries in `directory` durable (POSIX: fsync the directory itself)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_pointer(pointer: Path) -> str | None:
    """The directory name a `latest` pointer holds; None when it is missing, unreadable or not UTF-8 text."""
    try:
        return pointer.read_bytes().decode("utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def library_versions() -> dict[str, str]:
    """The versions a checkpoint was written with; `gaudi3-scale-commit` the source tree's commit when the package
    runs from a git checkout (its version alone does not tell two checkouts apart)."""
    from importlib.metadata import PackageNotFoundError, version

    from gaudi3_scale.source import source_revision

    versions = {"python": platform.python_version()}
    for name in ("gaudi3-scale", "torch", "lightning", "deepspeed"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    if (revision := source_revision()) is not None:
        versions["gaudi3-scale-commit"] = revision
    return versions


def _payload_files(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(".tmp")
    )


def write_manifest(directory: Path, metadata: dict[str, Any]) -> dict[str, Any]:
    """Checksum every file in `directory` and commit it with `metadata` (step, tokens, world size, …)."""
    files = {
        p.relative_to(directory).as_posix(): {"size_bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in _payload_files(directory)
    }
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        **metadata,
        "versions": library_versions(),
        "created_unix_s": time.time(),
        "hash": "sha256",
        "files": files,
    }
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(directory / MANIFEST_NAME)
    fsync_directory(directory)
    return manifest


class ManifestError(ValueError):
    """A manifest that is not one this build wrote: unreadable, another format or version, or malformed."""


_SHA256 = re.compile(r"[0-9a-f]{64}")
# Metadata that readers format or compare (ckpt list, retention, resume checks): its type is part of the schema.
_OPTIONAL_INTS = ("step", "epoch", "tokens_seen", "world_size", "val_loss_step")
_OPTIONAL_STRS = ("strategy", "layout", "config_sha256", "data_sha256", "tokenizer_sha256", "tier")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _files_problem(files: Any) -> str | None:
    if not isinstance(files, dict):
        return f"'files' is a {type(files).__name__}, not a mapping"
    for name, entry in files.items():
        path = PurePosixPath(name)
        if not name or path.is_absolute() or ".." in path.parts or name == MANIFEST_NAME:
            return f"unsafe file name {brief(name)}"
        if not isinstance(entry, dict):
            return f"files[{brief(name)}] is a {type(entry).__name__}, not {{size_bytes, sha256}}"
        size = entry.get("size_bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"files[{brief(name)}].size_bytes is {brief(size)}, not a byte count"
        if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
            return f"files[{brief(name)}].sha256 is {brief(entry.get('sha256'))}, not 64 hex digits"
    return None


def _schema_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"not a {FORMAT} manifest"
    if not _is_int(manifest.get("version")) or manifest["version"] != FORMAT_VERSION:
        return f"manifest version {brief(manifest.get('version'))}; this build reads {FORMAT_VERSION}"
    if not manifest.get("files"):
        return "the manifest lists no files"
    if problem := _files_problem(manifest["files"]):
        return f"malformed {MANIFEST_NAME}: {problem}"
    for key in _OPTIONAL_INTS:
        if manifest.get(key) is not None and not _is_int(manifest[key]):
            return f"malformed {MANIFEST_NAME}: {key} is {brief(manifest[key])}, not an integer"
    for key in _OPTIONAL_STRS:
        if manifest.get(key) is not None and not isinstance(manifest[key], str):
            return f"malformed {MANIFEST_NAME}: {key} is {brief(manifest[key])}, not a string"
    semantics = manifest.get("model_semantics")
    if semantics is not None and (
        not isinstance(semantics, list) or not all(isinstance(name, str) for name in semantics)
    ):
        return f"malformed {MANIFEST_NAME}: model_semantics is {brief(semantics)}, not a list of names"
    loss = manifest.get("val_loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, int | float)):
        return f"malformed {MANIFEST_NAME}: val_loss is {brief(loss)}, not a number"
    return None


def parse_manifest(data: bytes | str) -> dict[str, Any]:
    """The manifest in `data` (a `manifest.json`'s bytes), schema-checked; `ManifestError` says what is wrong.

    The one place that decides whether a manifest is well formed: local checkpoints, remote copies and uploads
    all go through it, so code that reads a manifest's fields never meets a shape it does not expect.
    """
    try:
        text = data if isinstance(data, str) else decode_utf8(data, MANIFEST_NAME)
        manifest = parse_json(text, where=MANIFEST_NAME, expect=None)  # the limits every file read here gets
    except UserInputError as exc:
        raise ManifestError(str(exc)) from None
    if problem := _schema_problem(manifest):
        raise ManifestError(problem)
    return manifest


def has_manifest(directory: Path) -> bool:
    """Whether `directory` was committed (a manifest was renamed into it), intact or not."""
    return (directory / MANIFEST_NAME).is_file()


def _read_regular(path: Path) -> bytes:
    """The bytes of `path`, which must be a regular file: a FIFO or a device there (planted, or a stray
    `mkfifo`) is refused without blocking on it (O_NONBLOCK), and checked on the opened file, not before it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ManifestError(f"{MANIFEST_NAME} is not a regular file")
        return f.read()


def _load(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) for a well-formed committed manifest, else (None, why not)."""
    try:
        return parse_manifest(_read_regular(directory / MANIFEST_NAME)), None
    except FileNotFoundError:
        return None, f"no committed manifest ({MANIFEST_NAME} missing)"
    except OSError as exc:
        return None, f"{MANIFEST_NAME} unreadable ({exc.strerror or exc})"
    except ManifestError as exc:
        return None, str(exc)


def manifest_problem(directory: Path) -> str | None:
    """Why `directory` holds no usable manifest (missing, unreadable, malformed), or None when it does."""
    return _load(directory)[1]


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest, or None when the directory was never committed or its manifest is damaged (unreadable,
    another format or version, malformed: `manifest_problem` says which)."""
    return _load(directory)[0]


STATE_NAME = "state.ckpt"  # a single-file checkpoint's state (a directory of files under DeepSpeed)
# A sharded one's (`checkpoint.sharded`): DCP's index of the shard files, and rank 0's non-tensor state
DCP_INDEX_NAME, SHARDED_META_NAME = ".metadata", "meta.pt"
DCP_NAMES = (DCP_INDEX_NAME, SHARDED_META_NAME)
_STEP_DIRECTORY = re.compile(r"step-(\d+)")


def manifest_layout(manifest: dict[str, Any]) -> str:
    """ "sharded" or "single-file": what the manifest commits, never what else lies in the directory (a stray
    `.metadata` beside a verified `state.ckpt` decides nothing). Manifests that predate the `layout` field: by
    the files they list."""
    if manifest.get("layout") == "sharded" or all(name in manifest["files"] for name in DCP_NAMES):
        return "sharded"
    return "single-file"


def _dcp_storage_files(directory: Path) -> set[str]:
    """The shard files DCP's index names (relative to `directory`): what a load of the checkpoint opens."""
    from torch.distributed.checkpoint import FileSystemReader  # torch: only for sharded checkpoints

    return {info.relative_path for info in FileSystemReader(directory).read_metadata().storage_data.values()}


def _layout_problem(directory: Path, manifest: dict[str, Any]) -> str | None:
    """What the manifest's layout needs that it does not list: `state.ckpt`, or DCP's index, `meta.pt` and
    every shard file the index names (a manifest may omit a file that is then missing too)."""
    files = manifest["files"]
    if manifest_layout(manifest) == "single-file":
        if not any(name == STATE_NAME or name.startswith(f"{STATE_NAME}/") for name in files):
            return f"{directory.name}: the manifest lists no {STATE_NAME}"
        return None
    for name in DCP_NAMES:
        if name not in files:
            return f"{directory.name}: a sharded checkpoint whose manifest lists no {name}"
    try:
        named = _dcp_storage_files(directory)
    except Exception as exc:  # the index itself verified, so this is a DCP version this torch cannot read
        return f"{directory.name}/{DCP_INDEX_NAME}: not readable by this torch ({type(exc).__name__})"
    unlisted = sorted(named - files.keys())
    if unlisted:
        return f"{directory.name}/{unlisted[0]}: named by the shard index but not by the manifest"
    return None


def verify_checkpoint(directory: Path) -> list[str]:
    """What is wrong with a checkpoint directory (an empty list means committed and intact): its manifest
    damaged, or naming another step than the directory's name; a listed file missing, of another size or
    checksum; a file its layout needs not listed."""
    if not directory.is_dir():
        return [f"{directory} is not a directory"]
    manifest, problem = _load(directory)
    if manifest is None:
        return [f"{directory.name}: {problem}"]
    named = _STEP_DIRECTORY.fullmatch(directory.name)
    if named and manifest.get("step") is not None and manifest["step"] != int(named[1]):
        # a copied or renamed checkpoint: ranked by its name it would rewind a resume and steer retention
        return [f"{directory.name}: its manifest is of step {manifest['step']} (copied or renamed)"]
    fingerprint = _fingerprint(directory, manifest)
    if fingerprint is not None and _verified_recently(directory, fingerprint):
        return []
    problems = []
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{directory.name}/{name}: missing")
        elif path.stat().st_size != entry["size_bytes"]:
            problems.append(
                f"{directory.name}/{name}: {path.stat().st_size} bytes, the manifest says {entry['size_bytes']}"
            )
        elif file_sha256(path) != entry["sha256"]:
            problems.append(f"{directory.name}/{name}: SHA-256 does not match the manifest (corrupt)")
    if not problems and (problem := _layout_problem(directory, manifest)):
        problems.append(problem)
    if not problems and fingerprint is not None:  # taken before hashing: a file changed since is hashed again
        _VERIFIED[str(directory.resolve())] = (fingerprint, time.time())
    return problems


# How long a launcher's verification stands in for its ranks' (they start within a minute of its check; an elastic
# restart much later verifies anew), and how it is handed to them: only the launcher's own children take it.
VERIFIED_TRUST_S = 900.0
VERIFIED_ENV = "GAUDI3_VERIFIED_CHECKPOINTS"
_VERIFIED: dict[str, tuple[str, float]] = {}  # this process's: resolved directory → (fingerprint, unix time)


def _fingerprint(directory: Path, manifest: dict[str, Any]) -> str | None:
    """What identifies the bytes a verification covered without reading them: the manifest, and each listed file's
    size, mtime, ctime and inode (None when one is missing: nothing to trust)."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode())
    for name in sorted(manifest["files"]):
        try:
            info = (directory / name).stat()
        except OSError:
            return None
        stamp = (name, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev)
        digest.update(repr(stamp).encode())
    return digest.hexdigest()


def _verified_recently(directory: Path, fingerprint: str) -> bool:
    """Whether this process's launcher (its parent) verified `directory` within `VERIFIED_TRUST_S`, and no listed
    file has changed since. A process never trusts its own earlier verification: it hashes again. The parent test
    is by PID: in a container whose launcher is PID 1 an orphaned descendant that inherited the variable passes it
    too, but never with a changed file (the fingerprint must still match; on a filesystem whose mtime and ctime
    are synthetic, as on some object-store mounts, that check is only as good as those times)."""
    try:
        handed = json.loads(os.environ.get(VERIFIED_ENV) or "{}")
        parent, entries = int(handed["launcher_pid"]), handed["checkpoints"]
        saved, when = entries[str(directory.resolve())]
        when = float(when)
    except (ValueError, TypeError, LookupError, AttributeError):  # none handed down, or malformed: verify
        return False
    return parent == os.getppid() and saved == fingerprint and 0 <= time.time() - when <= VERIFIED_TRUST_S


def hand_down_verified(directory: Path) -> None:
    """Let the processes this one starts from now on (a launcher's ranks) take `directory` as verified, if this
    process verified it; each still checks that no listed file has changed (`_fingerprint`) and that the
    verification is at most `VERIFIED_TRUST_S` old."""
    key = str(directory.resolve())
    if (entry := _VERIFIED.get(key)) is not None:
        os.environ[VERIFIED_ENV] = json.dumps(
            {"launcher_pid": os.getpid(), "checkpoints": {key: list(entry)}}
        )
