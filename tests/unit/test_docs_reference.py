"""The generated reference pages (docs/reference/cli.md, config.md, deploy_options.md) are what the code generates
today.

`GAUDI3_UPDATE_DOCS=1` rewrites them instead of failing (as `python3 run.py docs --generate` does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gaudi3_scale.cli.main import VERBS
from gaudi3_scale.cli.reference import reference_pages, stale_pages
from gaudi3_scale.config.core import iter_fields
from gaudi3_scale.deploy.render import target_options
from gaudi3_scale.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def test_generated_reference_pages_are_up_to_date() -> None:
    if os.environ.get("GAUDI3_UPDATE_DOCS") == "1":
        for path, text in reference_pages(ROOT).items():
            path.write_text(text, encoding="utf-8")
    stale = [str(p.relative_to(ROOT)) for p in stale_pages(ROOT)]
    assert stale == [], f"{stale} are stale: run `python3 run.py docs --generate` (or GAUDI3_UPDATE_DOCS=1)"


def test_the_pages_hold_every_verb_flag_and_field() -> None:
    pages = reference_pages(ROOT)
    cli_page = pages[ROOT / "docs/reference/cli.md"]
    config_page = pages[ROOT / "docs/reference/config.md"]
    for verb in VERBS:
        assert f"## `gaudi3 {verb}`" in cli_page, verb
    for flag in ("--nproc-per-node", "--estimate-only", "--kv-cache", "--max-tokens-limit", "--register"):
        assert f"`{flag}`" in cli_page, flag
    assert "| `--kv-cache` | dynamic \\| static \\| off | `dynamic` |" in cli_page  # its choices, escaped
    for name, _tp, _f in iter_fields(RunConfig):
        assert f"| `{name}` |" in config_page, name
    assert "| `train.max_steps` | `int` |" in config_page
    deploy_page = pages[ROOT / "docs/reference/deploy_options.md"]
    options = target_options()
    assert sorted(options) == ["ci", "k8s", "onprem"]
    for target, cls in options.items():
        section = deploy_page.split(f"## `{target}`\n", 1)[1].split("\n## ", 1)[0]
        for name, _tp, _f in iter_fields(cls):
            assert f"| `{name}` |" in section, (target, name)
    assert "| `storage` | `pvc \\| emptydir` | `pvc` |" in deploy_page
    assert "`aws`, `azure`, `gcp` take no options" in deploy_page


def test_a_key_of_the_deploy_options_page_is_what_render_reads(tmp_path: Path) -> None:
    """`--set` with a key the page lists for k8s renders with it; the same key for a Terraform target is refused,
    naming the targets the page lists (one registry: what renders is what is documented)."""
    config = tmp_path / "run.yaml"
    config.write_text("name: demo\ntrain:\n  global_batch_size: 16\n")
    base = ["deploy", "render", "--config", str(config), "--nodes", "1", "--accelerator", "h100"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}

    def render(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *base, *args], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    ok = render("--target", "k8s", "--set", "namespace=team-a", "--out", str(tmp_path / "k8s"))
    assert ok.returncode == 0, ok.stderr
    assert "namespace: team-a" in (tmp_path / "k8s" / "k8s" / "pytorchjob.yaml").read_text()
    refused = render("--target", "aws", "--set", "namespace=team-a", "--out", str(tmp_path / "aws"))
    assert refused.returncode == 2
    assert "--target aws takes no options (only ci, k8s, onprem take them)" in refused.stderr


def test_check_names_a_stale_page_and_fails(tmp_path: Path) -> None:
    """The command-line check, run the way `run.py docs` runs the writer: a missing page is stale, then fixed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = [sys.executable, "-m", "gaudi3_scale.cli.reference"]
    proc = subprocess.run(
        [*run, "--check"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "docs/reference/cli.md is stale" in proc.stdout, proc
    subprocess.run([*run, "--write"], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)
    (tmp_path / "docs/reference/config.md").write_text("# hand-edited\n")
    proc = subprocess.run(
        [*run, "--check"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and proc.stdout.splitlines() == [
        "docs/reference/config.md is stale: run python3 run.py docs --generate"
    ], proc


def test_exit_code_page_matches_the_constants() -> None:
    import re
    import signal

    from gaudi3_scale.config.errors import INTERRUPTED_EXIT_CODE, UserInputError
    from gaudi3_scale.deploy.bootstrap import NO_RESTART_EXIT_CODES
    from gaudi3_scale.deploy.k8s_job import RETRYABLE_EXIT_CODES
    from gaudi3_scale.distributed.launch import RESTARTABLE_EXIT_CODES, signal_exit_code
    from gaudi3_scale.health.guard import HEALTH_STOP_EXIT_CODE
    from gaudi3_scale.health.watchdog import HANG_EXIT_CODE
    from gaudi3_scale.metering.live import BUDGET_EXIT_CODE, SPOT_PAUSE_EXIT_CODE

    page = (ROOT / "docs/reference/exit_codes.md").read_text(encoding="utf-8")
    rows = {int(code): text for code, text in re.findall(r"^\| (\d+) \| (.*)$", page, flags=re.M)}
    assert sorted(rows) == [0, 1, 2, 3, 4, 5, 130, 138, 143]
    assert INTERRUPTED_EXIT_CODE == 128 + signal.SIGINT and "Ctrl-C" in rows[130]
    assert UserInputError.exit_code == 2 and "bad input" in rows[2]
    assert BUDGET_EXIT_CODE == 3 and "cost.budget_usd" in rows[3]
    assert SPOT_PAUSE_EXIT_CODE == 4 and "spot" in rows[4]
    assert HEALTH_STOP_EXIT_CODE == 5 and "health.max_dropped_in_a_row" in rows[5]
    assert (
        signal_exit_code(signal.SIGUSR1) == 138 and signal_exit_code(signal.SIGTERM) == 143 == HANG_EXIT_CODE
    )
    assert signal_exit_code(signal.SIGINT) == 0
    assert {c for c, text in rows.items() if "| yes" in text} == RESTARTABLE_EXIT_CODES
    assert set(NO_RESTART_EXIT_CODES) == {c for c, text in rows.items() if "| no" in text} - {0}
    assert "130, 137, 138 and 143" in page and RETRYABLE_EXIT_CODES == (130, 137, 138, 143)
