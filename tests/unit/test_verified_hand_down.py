"""A launcher's verification handed to its ranks (`checkpoint.manifest.hand_down_verified`): hashing every file is
what a resume spends its time on, and the launcher and each rank it starts verified the same checkpoint (a sharded
one: every rank hashed every rank's shards). The ranks, started as real child processes here, take the launcher's
verification only while no listed file has changed and it is fresh; nobody else takes it, the launcher included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gaudi3_scale.checkpoint.manifest import (
    VERIFIED_ENV,
    hand_down_verified,
    verify_checkpoint,
    write_manifest,
)

SRC = str(Path(__file__).resolve().parents[2] / "src")

# A rank: verifies the checkpoint with hashing made to fail loudly, and prints what verify_checkpoint said.
RANK = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import gaudi3_scale.checkpoint.manifest as manifest

    def hashed(path):
        raise SystemExit(f"hashed {path.name}")

    manifest.file_sha256 = hashed
    print(json.dumps(manifest.verify_checkpoint(Path(sys.argv[1]))))
    """
)


def _checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "checkpoints" / "step-00000004"
    directory.mkdir(parents=True)
    (directory / "state.ckpt").write_bytes(os.urandom(4096))
    write_manifest(directory, {"step": 4})
    return directory


def _rank(directory: Path, env: dict[str, str]) -> str:
    """What a child process of this one (a launcher's rank) says: '[]' when it took the verification."""
    done = subprocess.run(
        [sys.executable, "-c", RANK, str(directory)],
        env={**os.environ, **env, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return (done.stdout + done.stderr).strip()


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process as a launcher, undone afterwards: the variable `hand_down_verified` sets (set, then deleted, so
    that monkeypatch records the undo even when it was absent) and the record of what this process verified."""
    import gaudi3_scale.checkpoint.manifest as manifest

    monkeypatch.setenv(VERIFIED_ENV, "")
    monkeypatch.delenv(VERIFIED_ENV)
    monkeypatch.setattr(manifest, "_VERIFIED", {})
    return os.environ  # type: ignore[return-value]


def test_a_rank_takes_its_launchers_verification_of_unchanged_files(
    tmp_path: Path, launcher_env: dict
) -> None:
    directory = _checkpoint(tmp_path)
    assert _rank(directory, {}) == "hashed state.ckpt"  # nothing handed down: a rank hashes
    hand_down_verified(directory)  # not verified by this process yet: nothing to hand down
    assert VERIFIED_ENV not in os.environ
    assert verify_checkpoint(directory) == []
    hand_down_verified(directory)
    assert _rank(directory, {}) == "[]"
    assert _rank(directory, {VERIFIED_ENV: os.environ[VERIFIED_ENV]}) == "[]"


def test_a_changed_file_is_hashed_again_and_its_damage_named(tmp_path: Path, launcher_env: dict) -> None:
    directory = _checkpoint(tmp_path)
    assert verify_checkpoint(directory) == []
    hand_down_verified(directory)
    state = directory / "state.ckpt"
    data = bytearray(state.read_bytes())
    data[100] ^= 0xFF
    before = state.stat()
    state.write_bytes(bytes(data))
    os.utime(state, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size and mtime: its ctime moved
    assert _rank(directory, {}) == "hashed state.ckpt"
    assert verify_checkpoint(directory) == [
        "step-00000004/state.ckpt: SHA-256 does not match the manifest (corrupt)"
    ]


def test_only_the_launchers_children_take_a_fresh_verification(tmp_path: Path, launcher_env: dict) -> None:
    directory = _checkpoint(tmp_path)
    assert verify_checkpoint(directory) == []
    hand_down_verified(directory)
    handed = json.loads(os.environ[VERIFIED_ENV])
    # the launcher itself hashes again (it trusts no earlier verification of its own)
    import gaudi3_scale.checkpoint.manifest as manifest

    calls: list[str] = []
    real = manifest.file_sha256
    manifest.file_sha256 = lambda path: calls.append(path.name) or real(path)  # type: ignore[assignment]
    try:
        assert verify_checkpoint(directory) == []
    finally:
        manifest.file_sha256 = real  # type: ignore[assignment]
    assert calls == ["state.ckpt"]
    # a process another one started (not this launcher's child)
    other = {**handed, "launcher_pid": os.getpid() + 100_000}
    assert _rank(directory, {VERIFIED_ENV: json.dumps(other)}) == "hashed state.ckpt"
    # a verification older than VERIFIED_TRUST_S (an elastic restart long after the launcher's check)
    key, (fingerprint, when) = next(iter(handed["checkpoints"].items()))
    stale = {**handed, "checkpoints": {key: [fingerprint, when - manifest.VERIFIED_TRUST_S - 1]}}
    assert _rank(directory, {VERIFIED_ENV: json.dumps(stale)}) == "hashed state.ckpt"
    # malformed: verified as if nothing were handed down
    for junk in ("{", "[]", '{"launcher_pid": "x"}', json.dumps({**handed, "checkpoints": {key: 5}})):
        assert _rank(directory, {VERIFIED_ENV: junk}) == "hashed state.ckpt"
