"""`gaudi3 ckpt list | verify | diff` on real checkpoints, resume skipping a corrupt latest checkpoint, a malformed
manifest treated as damage by every command, and a run directory accepted wherever a checkpoint is; what must never
change a run's saved state: a refused resume, a run whose every checkpoint is damaged, retention after resuming an
older checkpoint, `ckpt export --force`; stray files, copied checkpoints and a `latest` that is not text."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import CliResult

pytestmark = pytest.mark.integration

TRAIN = ["train", "--sample-tokens", "0", "--no-progress", "--train.val_every_steps", "0", "--model.num_layers", "1",
         "--optim.warmup_steps", "1", "--checkpoint.every_steps", "2", "--train.val_batches", "2"]  # fmt: skip
Cli = Callable[
    ..., CliResult
]  # the `gaudi3_cli` fixture: `gaudi3 ARGS…` in this process, (exit code, out, err)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gaudi3_scale.cli.main import main

    out = tmp_path_factory.mktemp("ckpt") / "run"
    main([*TRAIN, "--out", str(out), "--train.max_steps", "4"])
    return out


def test_list_and_verify_intact_checkpoints(run_dir: Path, gaudi3_cli: Cli) -> None:
    code, stdout, stderr = gaudi3_cli("ckpt", "list", str(run_dir), "--verify")
    assert code == 0, stderr
    rows = [line for line in stdout.splitlines() if "│" in line and line.split("│")[1].strip().isdigit()]
    assert [r.split("│")[1].strip() for r in rows] == ["2", "4"]
    assert all(" ok " in r for r in rows) and "*" in rows[-1]
    code, stdout, _ = gaudi3_cli("ckpt", "verify", str(run_dir / "checkpoints" / "step-00000004"))
    assert code == 0 and stdout.strip().endswith(": ok")


def test_diff_reports_identical_and_the_first_difference(
    run_dir: Path, tmp_path: Path, gaudi3_cli: Cli
) -> None:
    again = tmp_path / "again"
    assert gaudi3_cli(*TRAIN, "--out", str(again), "--train.max_steps", "4")[0] == 0
    steps = run_dir / "checkpoints"
    code, stdout, stderr = gaudi3_cli(
        "ckpt", "diff", str(steps / "step-00000004"), str(again / "checkpoints")
    )
    assert code == 0 and stdout.startswith("identical"), stdout + stderr
    code, stdout, _ = gaudi3_cli("ckpt", "diff", str(steps / "step-00000002"), str(steps / "step-00000004"))
    assert code == 1 and "first difference: global_step: 2 vs 4" in stdout


def test_corrupt_latest_is_named_and_skipped_on_resume(
    run_dir: Path, tmp_path: Path, gaudi3_cli: Cli
) -> None:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    state = out / "checkpoints" / "step-00000004" / "state.ckpt"
    data = bytearray(state.read_bytes())
    data[len(data) // 3] ^= 0x40
    state.write_bytes(bytes(data))
    code, stdout, _ = gaudi3_cli("ckpt", "verify", str(state))
    assert code == 1 and "SHA-256 does not match the manifest" in stdout
    assert gaudi3_cli("ckpt", "list", str(out), "--verify")[0] == 1
    code, _, stderr = gaudi3_cli(*TRAIN, "--out", str(out), "--train.max_steps", "6")
    assert code == 0, stderr
    warning = [line for line in stderr.splitlines() if "skipping checkpoint" in line]
    assert len(warning) == 1 and "step-00000004" in warning[0]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    # Training passed step 4 again: the damaged copy was set aside, not overwritten or deleted.
    assert (out / "checkpoints" / "step-00000004.damaged-1" / "state.ckpt").read_bytes() == bytes(data)
    assert gaudi3_cli("ckpt", "verify", str(out / "checkpoints" / "step-00000004"))[0] == 0
    damaged = out / "checkpoints" / "step-00000004.damaged-1"
    code, _, stderr = gaudi3_cli(
        *TRAIN, "--out", str(tmp_path / "new"), "--train.max_steps", "6", "--train.resume", str(damaged)
    )
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    assert "train.resume" in stderr and "SHA-256" in stderr


def test_verify_a_missing_checkpoint_is_one_line_and_exit_2(tmp_path: Path, gaudi3_cli: Cli) -> None:
    code, _, stderr = gaudi3_cli("ckpt", "verify", str(tmp_path / "nope"))
    assert code == 2 and stderr.strip() == f"gaudi3: error: checkpoint '{tmp_path / 'nope'}' does not exist"


def test_malformed_manifest_is_damage_for_every_command(
    run_dir: Path, tmp_path: Path, gaudi3_cli: Cli
) -> None:
    """Valid JSON of the wrong shape: no KeyError anywhere; listed and verified as damaged, refused by name when
    named, skipped by a resume for the previous intact checkpoint (and set aside, not overwritten)."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    step4 = out / "checkpoints" / "step-00000004"
    manifest = json.loads((step4 / "manifest.json").read_text())
    (step4 / "manifest.json").write_text(json.dumps({**manifest, "files": {"state.ckpt": {}}}))
    problem = "malformed manifest.json: files['state.ckpt'].size_bytes is None, not a byte count"
    code, stdout, _ = gaudi3_cli("ckpt", "verify", str(step4))
    assert code == 1 and stdout.strip() == f"{step4}: step-00000004: {problem}"
    code, stdout, _ = gaudi3_cli("ckpt", "verify", str(out))  # a run directory: each of its checkpoints
    assert code == 1 and stdout.splitlines()[0].endswith("step-00000002: ok") and problem in stdout
    for flags in ((), ("--verify",)):  # a manifest of the wrong shape is damage even without hashing
        code, stdout, stderr = gaudi3_cli("ckpt", "list", str(out), *flags)
        assert code == 1 and "malformed" in stdout and stderr == ""
    for args, field in [
        (("ckpt", "diff", str(out / "checkpoints" / "step-00000002"), str(step4)), "checkpoint"),
        ((*TRAIN, "--out", str(tmp_path / "new"), "--train.resume", str(step4)), "train.resume"),
    ]:
        code, _, stderr = gaudi3_cli(*args)
        assert code == 2 and stderr.count("\n") == 1 and stderr.startswith(f"gaudi3: error: {field}"), stderr
        assert problem in stderr
    (step4 / "manifest.json").write_text(json.dumps({**manifest, "files": ["state.ckpt"]}))
    code, _, stderr = gaudi3_cli(*TRAIN, "--out", str(out), "--train.max_steps", "5")
    assert code == 0, stderr
    assert (
        "skipping checkpoint" in stderr
        and "step-00000004: malformed manifest.json: 'files' is a list" in stderr
    )
    # Resumed from step 2: step 4 was trained and committed again, the damaged copy set aside beside it.
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000005"
    assert gaudi3_cli("ckpt", "verify", str(step4))[0] == 0
    assert (out / "checkpoints" / "step-00000004.damaged-1" / "state.ckpt").is_file()


def test_a_run_directory_is_accepted_where_a_checkpoint_is(run_dir: Path, gaudi3_cli: Cli) -> None:
    step4 = run_dir / "checkpoints" / "step-00000004"
    by_step = gaudi3_cli("generate", str(step4), "--max-new-tokens", "12", "--prompt", "ROMEO:")
    by_run = gaudi3_cli("generate", str(run_dir), "--max-new-tokens", "12", "--prompt", "ROMEO:")
    assert by_run == by_step and by_run[0] == 0 and by_run[1].startswith("ROMEO:")
    code, stdout, _ = gaudi3_cli("ckpt", "diff", str(run_dir), str(step4))
    assert code == 0 and stdout.startswith("identical"), stdout


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_refused_resume_changes_nothing_in_the_run(run_dir: Path, gaudi3_cli: Cli) -> None:
    """Another tokenizer or seed is refused before the data is opened (it names the field that was changed, not
    the vocabulary it would change): the run's config, tokenizer and checkpoints are still the ones it trained with."""
    before = _snapshot(run_dir)
    for args, field in [(("--data.tokenizer", "byte"), "data.tokenizer"), (("--seed", "1"), "seed")]:
        code, _, stderr = gaudi3_cli(*TRAIN, "--out", str(run_dir), "--train.max_steps", "6", *args)
        assert code == 2 and stderr.count("\n") == 1 and stderr.startswith(f"gaudi3: error: {field}: "), (
            stderr
        )
        assert _snapshot(run_dir) == before


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_not_started_over(
    run_dir: Path, tmp_path: Path, gaudi3_cli: Cli
) -> None:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    for step in ("step-00000002", "step-00000004"):
        _flip(out / "checkpoints" / step / "state.ckpt")
    before = _snapshot(out)
    code, _, stderr = gaudi3_cli(*TRAIN, "--out", str(out), "--train.max_steps", "6")
    lines = stderr.strip().splitlines()
    assert code == 2 and [line.split(":")[0] for line in lines] == ["warning", "warning", "gaudi3"], stderr
    assert lines[-1].startswith("gaudi3: error: train.resume: no checkpoint in ") and "SHA-256" in lines[-1]
    assert _snapshot(out) == before  # nothing set aside, nothing trained over


def test_resuming_an_older_checkpoint_keeps_the_new_one_and_the_newer_ones(
    run_dir: Path, tmp_path: Path, gaudi3_cli: Cli
) -> None:
    """keep_last 1 after resuming step 2 of a run that holds step 4: the step-3 checkpoint just committed stays
    (and `latest` names it), step 4 of the trajectory the run left stays, step 2 goes."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    step4 = _snapshot(out / "checkpoints" / "step-00000004")
    code, _, stderr = gaudi3_cli(*TRAIN, "--out", str(out), "--train.max_steps", "3", "--checkpoint.every_steps", "1",
                                 "--checkpoint.keep_last", "1",
                                 "--train.resume", str(out / "checkpoints" / "step-00000002"))  # fmt: skip
    assert code == 0, stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest",
        "step-00000003",
        "step-00000004",
    ]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    assert gaudi3_cli("ckpt", "verify", str(out))[0] == 0
    assert _snapshot(out / "checkpoints" / "step-00000004") == step4


def test_generate_and_export_refuse_a_tokenizer_larger_than_the_model(
    run_dir: Path, tmp_path: Path, gaudi3_cli: Cli
) -> None:
    byte_tokenizer = tmp_path / "byte"
    byte_tokenizer.mkdir()
    (byte_tokenizer / "tokenizer.json").write_text('{"type": "gaudi3-byte"}')
    want = "gaudi3: error: the tokenizer has 256 tokens but model 'shakespeare-char' only 65; "
    for args in [("generate", str(run_dir), "--max-new-tokens", "3"),
                 ("ckpt", "export", str(run_dir), "--out", str(tmp_path / "export"))]:  # fmt: skip
        code, _, stderr = gaudi3_cli(*args, "--tokenizer", str(byte_tokenizer))
        assert code == 2 and stderr.count("\n") == 1 and stderr.startswith(want), stderr
    assert not (tmp_path / "export").exists()


def test_export_force_never_replaces_a_committed_checkpoint_or_a_runs_tokenizer(
    run_dir: Path, gaudi3_cli: Cli
) -> None:
    before = _snapshot(run_dir)
    step2 = run_dir / "checkpoints" / "step-00000002"
    for out, problem in [
        (step2, f"holds the committed checkpoint {str(step2)!r}"),
        (run_dir / "checkpoints", "contains the checkpoint"),
        (step2 / "export", f"lies inside the committed checkpoint {str(step2)!r}"),
        (run_dir / "tokenizer", "is a run's tokenizer"),
    ]:
        code, _, stderr = gaudi3_cli("ckpt", "export", str(run_dir), "--out", str(out), "--force")
        assert code == 2 and stderr.count("\n") == 1 and problem in stderr, stderr
    assert _snapshot(run_dir) == before


def test_stray_files_a_copied_checkpoint_and_an_unreadable_pointer(
    run_dir: Path, tmp_path: Path, gaudi3_cli: Cli
) -> None:
    """Files the manifest does not list decide nothing; a copy under another step's name is damage; a `latest`
    that is not text is passed over by the tools, and named explicitly it is one line."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    step2, step4 = out / "checkpoints" / "step-00000002", out / "checkpoints" / "step-00000004"
    (step4 / ".metadata").write_bytes(b"")
    (step4 / "meta.pt").write_bytes(b"")
    code, stdout, _ = gaudi3_cli("ckpt", "diff", str(step4), str(run_dir / "checkpoints" / "step-00000004"))
    assert code == 0 and stdout.startswith("identical"), stdout
    shutil.copytree(step2, out / "checkpoints" / "step-00000008")
    code, stdout, _ = gaudi3_cli("ckpt", "verify", str(out))
    assert code == 1 and "step-00000008: its manifest is of step 2 (copied or renamed)" in stdout, stdout
    (out / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00step")
    code, stdout, stderr = gaudi3_cli("ckpt", "list", str(out))
    assert code == 0 and "│ 8 " in stdout, stderr  # every step listed, none marked latest
    code, _, stderr = gaudi3_cli("generate", str(out / "checkpoints" / "latest"), "--max-new-tokens", "3")
    assert code == 2 and stderr.count("\n") == 1 and "names no checkpoint directory" in stderr, stderr
    by_run = gaudi3_cli("generate", str(out), "--max-new-tokens", "12", "--prompt", "ROMEO:")
    assert by_run == gaudi3_cli(
        "generate", str(step4), "--max-new-tokens", "12", "--prompt", "ROMEO:"
    )  # not 8's
    assert by_run[0] == 0 and by_run != gaudi3_cli(
        "generate", str(step2), "--max-new-tokens", "12", "--prompt", "ROMEO:"
    )


def _plain(path: Path, **entries: object) -> Path:
    """A tiny plain checkpoint file (what `torch.save` of a Lightning checkpoint dict writes)."""
    import torch

    torch.save({"global_step": 2, "state_dict": {"model.w": torch.arange(4.0)}, **entries}, path)
    return path


def test_diff_names_an_entry_on_one_side_only_in_one_short_line(tmp_path: Path, gaudi3_cli: Cli) -> None:
    """A light checkpoint (no optimizer state) against a full one: `only in A/B`, never the entry's value; a value
    that is printed is bounded; "identical" names only what both sides hold."""
    import torch

    moments = [{"state": {i: {"exp_avg": torch.full((64,), 0.5)} for i in range(50)}, "note": "m" * 5000}]
    full = _plain(tmp_path / "full.ckpt", optimizer_states=moments)
    light, light2 = _plain(tmp_path / "light.ckpt"), _plain(tmp_path / "light2.ckpt")
    assert gaudi3_cli("ckpt", "diff", str(light), str(full)) == (
        1,
        "first difference: optimizer_states: only in B\n",
        "",
    )
    assert (
        gaudi3_cli("ckpt", "diff", str(full), str(light))[1]
        == "first difference: optimizer_states: only in A\n"
    )
    assert gaudi3_cli("ckpt", "diff", str(light), str(light2)) == (
        0,
        "identical: global_step, state_dict\n",
        "",
    )
    # Values of another kind than a tensor: shown, but cut to a few hundred characters.
    other = _plain(tmp_path / "other.ckpt", optimizer_states=[{**moments[0], "note": "n" * 5000}])
    code, stdout, _ = gaudi3_cli("ckpt", "diff", str(full), str(other))
    assert code == 1 and stdout.startswith("first difference: optimizer_states[0].note: 'mmm")
    assert stdout.count("\n") == 1 and len(stdout) < 400, stdout


def test_diff_compares_the_step_guards_state_a_resume_restores(tmp_path: Path, gaudi3_cli: Cli) -> None:
    """The guard's skipped batches, spike histories and lr factor change training after a resume: a difference
    there is one, however equal the weights."""
    guard = {
        "skips": {"skipped": [], "dropped": []},
        "loss_history": {"history": [4.2, 4.1]},
        "lr_scale": 1.0,
    }
    a = _plain(tmp_path / "a.ckpt", gaudi3_health=guard)
    b = _plain(tmp_path / "b.ckpt", gaudi3_health={**guard, "lr_scale": 0.5})
    assert gaudi3_cli("ckpt", "diff", str(a), str(b)) == (
        1,
        "first difference: gaudi3_health.lr_scale: 1.0 vs 0.5\n",
        "",
    )
    assert gaudi3_cli("ckpt", "diff", str(a), str(a)) == (
        0,
        "identical: global_step, state_dict, gaudi3_health\n",
        "",
    )


def test_diff_counts_nan_equal_to_nan(tmp_path: Path, gaudi3_cli: Cli) -> None:
    import torch

    nan = float("nan")
    a = _plain(tmp_path / "a.ckpt", state_dict={"model.w": torch.tensor([nan, 1.0, 3.0, nan])})
    b = _plain(tmp_path / "b.ckpt", state_dict={"model.w": torch.tensor([nan, 2.0, 3.0, nan])})
    c = _plain(tmp_path / "c.ckpt", state_dict={"model.w": torch.tensor([nan, 1.0, 3.0, 5.0])})
    assert gaudi3_cli("ckpt", "diff", str(a), str(b)) == (
        1,
        "first difference: state_dict.model.w: first at flat index 1: 1.0 vs 2.0; max |a-b| 1\n",
        "",
    )
    # A NaN on one side only is a difference (and its |a-b| is NaN).
    assert gaudi3_cli("ckpt", "diff", str(a), str(c))[1] == (
        "first difference: state_dict.model.w: first at flat index 3: nan vs 5.0; max |a-b| nan\n"
    )
    assert gaudi3_cli("ckpt", "diff", str(a), str(a))[0] == 0


def test_verify_a_run_without_checkpoints_a_stranger_and_a_plain_file(
    tmp_path: Path, gaudi3_cli: Cli
) -> None:
    """A run that has saved nothing yet: "no checkpoints", exit 0 (nothing damaged or uncommitted; `ckpt list`
    lists it empty, exit 0). A directory that is neither a run nor a checkpoint: `ckpt list`'s one line, exit 2.
    A plain checkpoint file: one line, exit 2 (there is no manifest to check it against)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert gaudi3_cli("ckpt", "verify", str(run)) == (0, f"{run}: no checkpoints\n", "")
    assert gaudi3_cli("ckpt", "list", str(run))[0] == 0
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("hi\n")
    code, stdout, stderr = gaudi3_cli("ckpt", "verify", str(stranger))
    assert (code, stdout) == (2, "") and stderr.count("\n") == 1 and "holds no checkpoints" in stderr, stderr
    assert gaudi3_cli("ckpt", "list", str(stranger)) == (code, stdout, stderr)
    plain = _plain(tmp_path / "model.ckpt")
    code, stdout, stderr = gaudi3_cli("ckpt", "verify", str(plain))
    assert (code, stdout) == (2, "") and stderr.count("\n") == 1, stderr
    assert stderr.startswith(
        f"gaudi3: error: '{plain}' is a file: only a checkpoint directory has a manifest to verify"
    )
    # A step-X directory that was never committed is still reported as such (exit 1), not refused.
    uncommitted = tmp_path / "checkpoints" / "step-00000006"
    uncommitted.mkdir(parents=True)
    code, stdout, _ = gaudi3_cli("ckpt", "verify", str(uncommitted))
    assert code == 1 and "no committed manifest" in stdout
