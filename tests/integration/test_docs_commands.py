"""Every fenced ```bash block of the Get started and How-to pages runs as written, on this CPU.

A page's blocks run in order, in one fresh directory (a later block may use what an earlier one wrote), each with
`bash -euo pipefail` and the venv's `gaudi3` and `python` first on PATH. A block that cannot run here in about a
minute is opted out by a marker on the line right before it, with its reason:

    <!-- skip-test: needs a GPU -->
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import missing_system_tool, oracles_env

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*(ROOT / "docs" / "get-started").glob("*.md"), *(ROOT / "docs" / "how-to").glob("*.md")])
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", flags=re.DOTALL | re.MULTILINE)
SKIP = re.compile(r"<!-- skip-test: (\S.*?) -->\s*$")
BLOCK_TIMEOUT_S = 300  # "under a minute" on a quiet machine; CI shares 2 cores between two test workers


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    skip_reason: str | None


def bash_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) != "bash":
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(page, line, match.group(2), skip.group(1) if skip else None))
    return blocks


def test_pages_are_found_and_each_has_a_block_that_runs() -> None:
    names = {p.relative_to(ROOT / "docs").as_posix() for p in PAGES}
    assert {"get-started/first-run.md", "how-to/fine-tune-hf-llama.md", "how-to/preemption.md"} <= names
    for page in PAGES:
        assert [b for b in bash_blocks(page) if b.skip_reason is None], (
            f"{page.name}: no bash block is tested"
        )


def test_a_marker_opts_out_only_the_block_right_after_it(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- skip-test: needs a GPU -->\n```bash\nnvidia-smi\n```\n\ntext\n\n```bash\necho hi\n```\n"
        "<!-- skip-test:  -->\n```bash\necho no reason\n```\n```python\nprint(1)\n```\n"
    )
    blocks = bash_blocks(page)
    assert [(b.line, b.skip_reason) for b in blocks] == [(2, "needs a GPU"), (8, None), (12, None)]


def _run_block(code: str, cwd: Path, env: dict[str, str], log: Path) -> tuple[int, str]:
    """bash in a session of its own, so what a block left running in the background (a server, after a failed
    command) is ended with it. Output goes to a file: a background child holding a pipe cannot stall the test."""
    with log.open("w") as out:
        popen = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = popen.wait(timeout=BLOCK_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):  # nothing of the block is left
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    return returncode, log.read_text(errors="replace")


@pytest.mark.integration
@pytest.mark.slow  # a page is several real commands: 5-100 s each on 2 shared cores
@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT / "docs").as_posix() for p in PAGES])
def test_page_commands_run(page: Path, tmp_path: Path) -> None:
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p),
    }
    blocks = [b for b in bash_blocks(page) if b.skip_reason is None]
    if any("transformers" in b.code for b in blocks):  # a reader of this page installed it
        env = oracles_env(env)
    if any(re.search(r"\bcurl\b", b.code) for b in blocks) and shutil.which("curl") is None:
        missing_system_tool("curl is not on PATH (a page's commands use it as a reader would)")
    for block in blocks:
        returncode, output = _run_block(
            block.code, tmp_path, env, tmp_path.parent / f"{page.stem}-{block.line}.log"
        )
        where = f"{page.relative_to(ROOT)}:{block.line}"
        assert returncode == 0, f"{where} exited {returncode}\n{block.code}\n{output[-6000:]}"
