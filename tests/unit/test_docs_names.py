"""Every command the README and the docs show names a real verb, real options and real config fields, and every
file they name is in the repository.

tests/integration/test_docs_commands.py runs the Get started and How-to pages' blocks; the other pages (health,
pipeline, checkpoints, foresight, …) and the commands in prose are only read. This checks all of them without
training anything:
- each `gaudi3 VERB [SUB] …` (also `gaudi3-train …`, `python3 run.py train …`, `python -m gaudi3_scale.cli …`)
  in a fenced block or an inline code span: each `--name` in it is an option of that command or, for a verb that
  takes config overrides (`train`, `tune`, `plan`, `doctor`, `repro`), a field of the run config (`--list-fields`);
- each config field named alone in prose (`` `--parallel.strategy fsdp` ``);
- each `benchmarks/NAME.py …`: the script exists and its argparse parser defines the options (read from its source;
  the first line of a command continued with a backslash);
- each `gaudi3 train …` on a page that is not executed resolves (`--print-config`, in this process), or fails with
  the `gaudi3: error:` line the page shows under it;
- each such command of an offline verb (`plan` without `--probe`, `tune --estimate-only`, `cost compare`,
  `cost catalog`) runs as written, in this process;
- each repository file a page names (`benchmarks/results/…`, `src/gaudi3_scale/…`, `tests/…`) exists.
A renamed flag, field or file then fails here until every page says the new name.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import pkgutil
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

import gaudi3_scale
from gaudi3_scale.cli.main import cli
from gaudi3_scale.config.core import iter_fields
from gaudi3_scale.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# Written as a pattern for the reader, not as a field: "any config field can be set as --section.field VALUE".
PLACEHOLDERS = {"--section.field", "--section.key", "--<section>.<field>"}
FIELDS = {f"--{name}" for name, _tp, _f in iter_fields(RunConfig)}

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
# The start of a command: the console scripts, the modules, or the README's `python3 run.py train`; the verb an alias
# or module stands for is put back in front of its words.
_START = re.compile(
    r"(?:(?<=^)|(?<=[\s(]))(?:gaudi3-(?P<alias>train|benchmark|deploy)|gaudi3|python3? run\.py"
    r"|python3? -m gaudi3_scale\.(?:cli|(?P<module>train)))(?=\s|$)"
)
_FLAG = re.compile(r"--[A-Za-z<][\w.<>-]*")
_END = re.compile(r"\s(?:&&|\|\||;|\||#|>|2>)\s|[;)]\s*$")  # where a shell command ends


@dataclass(frozen=True)
class Use:
    where: str  # page:line
    text: str  # the command as the page writes it
    words: list[str]  # its words after `gaudi3`
    error: str | None = None  # the `gaudi3: error: …` line the page shows right below it, if any


def _commands(text: str, line: int, where: str) -> list[Use]:
    uses = []
    for start in _START.finditer(text):
        rest = text[start.end() :]
        end = _END.search(rest)
        rest = rest[: end.start()] if end else rest
        head = text[start.start() : start.end()]
        try:
            words = shlex.split(rest, comments=True)
        except ValueError:  # an unclosed quote in a prose span: plain words are enough for the names
            words = rest.split()
        before = text[: start.start()].split()
        if before and (before[-1].startswith("-") or before[-1] in ("grep", "echo")):
            continue  # a value (`--accelerator gaudi3`, `grep -c gaudi3`), not a command
        if "run.py" in head and (not words or words[0] != "train"):
            continue  # `run.py test` / `run.py docs` take pytest's and mkdocs' options
        verb = start.group("alias") or start.group("module")
        words = [verb, *words] if verb else words
        uses.append(Use(f"{where}:{line}", (head + rest).strip(), words))
    return uses


def _uses(page: Path, root: Path = ROOT) -> list[Use]:
    text, where = page.read_text(), page.relative_to(root).as_posix()
    found: list[Use] = []
    spans: list[tuple[int, int]] = []
    for block in _FENCE.finditer(text):
        spans.append(block.span())
        first = text.count("\n", 0, block.start(1)) + 1
        # Continuation lines joined, each command kept at the line it starts on.
        lines = block.group(1).split("\n")
        i = 0
        while i < len(lines):
            start, joined = i, lines[i]
            while joined.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined.rstrip()[:-1] + " " + lines[i]
            shown = lines[i + 1].strip() if i + 1 < len(lines) else ""
            error = shown if shown.startswith("gaudi3: error:") else None
            found += [
                dataclasses.replace(use, error=error)
                for use in _commands(joined.strip().removeprefix("$ "), first + start, where)
            ]
            i += 1
    for span in _INLINE.finditer(text):
        if any(a <= span.start() < b for a, b in spans):
            continue
        found += _commands(span.group(1), text.count("\n", 0, span.start()) + 1, where)
    return found


def _options(command: click.Command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
    return names


def _takes_overrides(command: click.Command) -> bool:
    return bool(command.context_settings.get("ignore_unknown_options"))


def problems(use: Use) -> list[str]:
    """What is wrong with one command a page shows: [] when its verb, subcommand, options and fields exist."""
    words = use.words
    if not words or words[0].startswith("-") or not re.fullmatch(r"[a-z][a-z-]*", words[0]):
        return []  # `gaudi3 --version`, or prose such as "`gaudi3 <verb>`"
    command: click.Command | None = cli.commands.get(words[0])
    if command is None:
        return [f"{words[0]!r} is not a gaudi3 verb (verbs: {', '.join(sorted(cli.commands))})"]
    name, rest = f"gaudi3 {words[0]}", words[1:]
    if isinstance(command, click.Group):
        if not rest or rest[0].startswith("-"):
            return []  # the group alone (`gaudi3 ckpt --help`)
        # A table cell may list alternatives: `gaudi3 deploy plan\|apply\|destroy DIR`.
        names = rest[0].replace("\\|", "|").split("|")
        unknown = [n for n in names if n not in command.commands]
        if unknown:
            return [f"{unknown[0]!r} is not a subcommand of {name} ({', '.join(sorted(command.commands))})"]
        command, name, rest = command.commands[names[0]], f"{name} {names[0]}", rest[1:]
    allowed = _options(command) | (FIELDS if _takes_overrides(command) else set())
    wrong = []
    for word in rest:
        if word == "--":
            break
        named = _FLAG.match(word)  # up to `=` or the punctuation of a sentence around it
        flag = named.group(0).rstrip(".") if named else ""
        if flag and flag not in allowed and flag not in PLACEHOLDERS:
            kind = "option or config field" if _takes_overrides(command) else "option"
            wrong.append(f"{flag} is not an {kind} of {name}")
    return wrong


USES = [use for page in PAGES for use in _uses(page)]


def test_the_pages_show_many_commands() -> None:
    """The extraction finds the commands (a broken pattern would make the check below pass on nothing)."""
    pages = {use.where.split(":")[0] for use in USES}
    assert len(USES) > 300 and len(pages) > 25, (len(USES), sorted(pages))
    verbs = {use.words[0] for use in USES if use.words}
    assert {"train", "tune", "plan", "ckpt", "deploy", "cost", "serve", "health"} <= verbs


def test_every_command_on_the_pages_names_real_verbs_options_and_fields() -> None:
    wrong = [f"{use.where}: `{use.text}`: {p}" for use in USES for p in problems(use)]
    assert not wrong, "\n".join(wrong)


SECTIONS = {name.split(".")[0] for name in FIELDS}


def field_problem(flag: str) -> str | None:
    """A config field named in prose (`--parallel.strategy fsdp`, `--parallel.*`): None when it exists."""
    if flag in FIELDS or flag in PLACEHOLDERS:
        return None
    if flag.endswith(".*") and flag[:-2] in SECTIONS:
        return None
    return f"{flag} is not a config field (`gaudi3 train --list-fields`)"


def prose_fields(page: Path, root: Path = ROOT) -> list[tuple[str, str]]:
    """(page:line, flag) of each inline code span that starts with a dotted `--section.field`; other `--flag` spans
    in prose may be any tool's (pytest, docker, a benchmark script), so only the config's own form is checked."""
    text, where = page.read_text(), page.relative_to(root).as_posix()
    found = []
    for span in re.finditer(r"`(--[^`\n]*)`", text):
        named = re.match(r"--[A-Za-z<][\w<>-]*\.[\w.*<>-]*", span.group(1))
        if named:
            found.append((f"{where}:{text.count(chr(10), 0, span.start()) + 1}", named.group(0).rstrip(".")))
    return found


def test_every_config_field_named_in_prose_exists() -> None:
    named = [use for page in PAGES for use in prose_fields(page)]
    assert len(named) > 30, len(named)  # the pattern finds them
    wrong = [f"{where}: {problem}" for where, flag in named if (problem := field_problem(flag))]
    assert not wrong, "\n".join(wrong)


def test_a_wrong_field_in_prose_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("With `--distributed.strategy fsdp` or `--parallel.*`, and `--train.max_steps.`\n")
    found = prose_fields(page, tmp_path)
    assert found == [
        ("page.md:1", "--distributed.strategy"),
        ("page.md:1", "--parallel.*"),
        ("page.md:1", "--train.max_steps"),
    ]
    assert [field_problem(flag) is None for _, flag in found] == [False, True, True]


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        (
            "gaudi3 train --model.name llama-tiny --train.max_step 5",
            "--train.max_step is not an option or config field",
        ),
        ("gaudi3 trian --out x", "'trian' is not a gaudi3 verb"),
        ("gaudi3 ckpt lst runs/x", "'lst' is not a subcommand of gaudi3 ckpt"),
        ("gaudi3 serve ckpt --kv-cache-size 3", "--kv-cache-size is not an option of gaudi3 serve"),
        ("gaudi3 health runs/x --model.name=llama-tiny", "--model.name is not an option of gaudi3 health"),
    ],
)
def test_a_wrong_name_is_found(command: str, problem: str, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"Run\n\n```bash\n{command} && echo done\n```\n\nand `{command}` in prose.\n")
    uses = _uses(page, tmp_path)
    assert [u.where for u in uses] == ["page.md:4", "page.md:7"]
    for use in uses:
        assert use.words[-1] != "done"  # the command ends at `&&`
        assert any(problem in p for p in problems(use)), problems(use)


def test_continuations_and_prose_are_read(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Say `gaudi3 plan --machine h100 --nodes 2` here.\n\n"
        "```bash\n$ gaudi3 train \\\n  --train.max_steps 5 \\\n  --no-progress  # short\n```\n"
    )
    assert [(u.where, u.words) for u in _uses(page, tmp_path)] == [
        ("page.md:4", ["train", "--train.max_steps", "5", "--no-progress"]),
        ("page.md:1", ["plan", "--machine", "h100", "--nodes", "2"]),
    ]
    assert not problems(_uses(page, tmp_path)[0])


BENCHMARKS = ROOT / "benchmarks"
_SCRIPT = re.compile(r"(?:(?<=^)|(?<=[\s(/`]))benchmarks/(?P<name>\w+)\.py(?P<rest>[^`\n]*)")


def script_options(script: Path) -> set[str]:
    """The `--options` a benchmark script's argparse parser defines (read from its source, not run)."""
    found = {"--help"}
    for node in ast.walk(ast.parse(script.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            negatable = any(
                k.arg == "action"
                and isinstance(k.value, ast.Attribute)
                and k.value.attr == "BooleanOptionalAction"
                for k in node.keywords
            )
            for name in names:
                if name.startswith("--"):
                    found.add(name)
                    if negatable:
                        found.add("--no-" + name[2:])
    return found


def script_problems(text: str, benchmarks: Path = BENCHMARKS) -> list[str]:
    """What is wrong with each `benchmarks/NAME.py …` command in `text`: a script that is not there, or an option
    its parser does not define."""
    wrong = []
    for use in _SCRIPT.finditer(text):
        script = benchmarks / f"{use['name']}.py"
        if not script.is_file():
            wrong.append(f"benchmarks/{script.name} does not exist")
            continue
        rest = use["rest"]
        end = _END.search(rest)
        options = script_options(script)
        for word in (rest[: end.start()] if end else rest).split():
            named = _FLAG.match(word)
            if word == "--":
                break
            if named and named.group(0).rstrip(".") not in options:
                wrong.append(f"{named.group(0).rstrip('.')} is not an option of benchmarks/{script.name}")
    return wrong


def test_every_benchmark_command_on_the_pages_names_a_real_script_and_options() -> None:
    wrong, seen = [], 0
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            seen += len(_SCRIPT.findall(line))
            wrong += [f"{page.relative_to(ROOT).as_posix()}:{number}: {p}" for p in script_problems(line)]
    assert seen > 50, seen  # the pattern finds the pages' benchmark commands
    assert not wrong, "\n".join(wrong)


def test_a_wrong_benchmark_command_is_found() -> None:
    assert script_problems("python benchmarks/bench_gpu.py --small --fp8-recipe rowwise") == []
    assert script_problems("`benchmarks/bench_gpu.py --smal`") == [
        "--smal is not an option of benchmarks/bench_gpu.py"
    ]
    assert script_problems("run benchmarks/bench_nothing.py") == [
        "benchmarks/bench_nothing.py does not exist"
    ]


# The pages whose blocks run for real (tests/integration/test_docs_commands.py): their commands need the files
# the blocks before them make.
EXECUTED = ("docs/get-started/", "docs/how-to/")
# A word the reader replaces: `<dir>`, `$OUT`, `…`, `runs/*`, an upper-case name such as PORT or N.
_PLACEHOLDER = re.compile(r"[<$…*]|\.\.\.|^[A-Z][A-Z_]*$")
# A synopsis's optional part or alternatives (`[--nodes`, `N]`, `h100|gaudi3`); a list value (`[15,31]`) is none.
_SYNOPSIS = re.compile(r"^\[-|^[^\[]*\]$|\|")


def _self_contained(use: Use) -> bool:
    """On a page that is not executed, and needs nothing the page leaves to the reader or made before: no
    placeholder, no config file, no synopsis (`[--nodes N]`, `h100|gaudi3`)."""
    return (
        bool(use.words)
        and not use.where.startswith(EXECUTED)
        and not any(_PLACEHOLDER.search(word) or _SYNOPSIS.search(word) for word in use.words)
        and not any(word.split("=")[0] in ("--config", "--model.init_from") for word in use.words)
    )


def resolvable(use: Use) -> bool:
    """A self-contained `gaudi3 train` command."""
    return _self_contained(use) and use.words[0] == "train"


def test_every_train_command_on_the_read_only_pages_resolves_or_fails_as_shown(
    gaudi3_cli: Callable[..., tuple[int, str, str]],
) -> None:
    """Each such command's config resolves (`gaudi3 train … --print-config`, in this process: the values, not
    only the names, are checked), and a command the page shows failing fails with the line it shows."""
    uses = [use for use in USES if resolvable(use)]
    assert len(uses) > 40 and sum(use.error is not None for use in uses) >= 1, len(uses)
    wrong = []
    for use in uses:
        code, _out, err = gaudi3_cli(*use.words, "--print-config")
        wrong += _unlike_the_page(use, code, err, ran=code == 0)
    assert not wrong, "\n".join(wrong)


def _unlike_the_page(use: Use, code: int, err: str, *, ran: bool) -> list[str]:
    """[] when a command did what its page shows: `ran` (its own success test), or the `gaudi3: error:` line the
    page shows under it with exit 2; else the one line saying how it differs."""
    if use.error is None:
        return [] if ran else [f"{use.where}: `{use.text}`: exit {code}: {err.strip()[-500:]}"]
    if code != 2 or err.strip() != use.error:
        return [f"{use.where}: `{use.text}` shows {use.error!r} but gives exit {code}: {err.strip()!r}"]
    return []


# The verbs that only compute, offline, in seconds: `plan` (not `--probe`, which trains), `tune --estimate-only`,
# `cost compare` and `cost catalog` (not `cost quote`, which asks a cloud's price API).
def runs_offline(use: Use) -> bool:
    """A self-contained command of an offline verb with more than its bare name (`gaudi3 plan` alone is prose)."""
    if not _self_contained(use):
        return False
    words = use.words
    if words[0] == "plan":
        return "--probe" not in words and len(words) > 1
    if words[0] == "tune":
        return "--estimate-only" in words and len(words) > 2
    return words[:2] in (["cost", "compare"], ["cost", "catalog"]) and len(words) > 2


def test_every_offline_command_on_the_read_only_pages_runs_or_fails_as_shown(
    gaudi3_cli: Callable[..., tuple[int, str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The llama3-405b plan, the estimate tables and the cost comparisons the pages quote run as written (in this
    process, in an empty directory), so a renamed model, machine or value fails here, not for a reader."""
    uses = [use for use in USES if runs_offline(use)]
    assert {use.words[0] for use in uses} == {"plan", "tune", "cost"} and len(uses) >= 6, uses
    monkeypatch.chdir(tmp_path)
    wrong = []
    for use in uses:
        code, out, err = gaudi3_cli(*use.words)
        wrong += _unlike_the_page(use, code, err, ran=code == 0 and bool(out.strip()))
    assert not wrong, "\n".join(wrong)


# Repository files the pages name (`benchmarks/results/gpu_cuda_h100*.json`, `src/gaudi3_scale/bench/schema.py`,
# `activation_checkpointing_cpu.{json,png}`); a URL's path (…/docs/stable/…) is not one.
_REPO_PATH = re.compile(r"(?<![\w./-])(?:src/gaudi3_scale|tests|benchmarks|requirements|docs)/[\w./{},*-]+")
# Results a page says a GPU session will write (issue 42): not there yet. Once one is, it leaves this set.
NOT_YET_WRITTEN = {"benchmarks/results/serve/serve_kv_cuda.json"}


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """The repository paths `text` names that match no file or directory under `root`."""
    missing = []
    for named in _REPO_PATH.findall(text):
        path = named.rstrip(".,:;")
        braces = re.search(r"\{([^}]*)\}", path)
        variants = (
            [path[: braces.start()] + part + path[braces.end() :] for part in braces.group(1).split(",")]
            if braces
            else [path]
        )
        if not all(any(root.glob(v)) if "*" in v else (root / v).exists() for v in variants):
            missing.append(path)
    return missing


def test_every_repository_file_the_pages_name_exists() -> None:
    named = [(page, path) for page in PAGES for path in _REPO_PATH.findall(page.read_text())]
    assert len(named) > 150, len(named)  # the pattern finds them
    wrong = [
        f"{page.relative_to(ROOT).as_posix()}: {path}"
        for page in PAGES
        for path in missing_paths(page.read_text())
        if path not in NOT_YET_WRITTEN
    ]
    assert not wrong, "\n".join(wrong)
    assert not [path for path in NOT_YET_WRITTEN if (ROOT / path).exists()], (
        "written now: drop it from the set"
    )


def test_a_missing_repository_file_is_found(tmp_path: Path) -> None:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "a_cpu.json").write_text("{}")
    text = (
        "See `benchmarks/results/a_cpu.{json,png}`, benchmarks/results/a_*.json, benchmarks/results/b.json. "
        "and https://docs.pytorch.org/docs/stable/x.html"
    )
    assert missing_paths(text, tmp_path) == [
        "benchmarks/results/a_cpu.{json,png}",
        "benchmarks/results/b.json",
    ]


# `health.watchdog.HANG_EXIT_CODE`, `gaudi3_scale.forecast.feed.feed_tune_trial`, `monitor.perf.mfu_above_peak()`:
# a dotted name whose first part is one of the package's modules; written with or without `gaudi3_scale.`.
_SYMBOL = re.compile(r"`((?:gaudi3_scale\.)?[a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?`")
_FILE_SUFFIXES = {"json", "yaml", "md", "png", "html", "pdf", "log", "bin", "py", "csv", "txt"}
# Names that look like ours but are another tool's: nvidia-smi's query fields (metrics.md).
NOT_SYMBOLS = {"memory.used", "memory.total"}


def symbol_problem(dotted: str) -> str | None:
    """None when `dotted` (relative to gaudi3_scale, or absolute) names a module or an attribute of one."""
    obj: object = gaudi3_scale
    walked = "gaudi3_scale"
    for part in dotted.removeprefix("gaudi3_scale.").split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif hasattr(obj, "__path__") and importlib.util.find_spec(f"{walked}.{part}") is not None:
            obj = importlib.import_module(f"{walked}.{part}")
        else:
            return f"{walked} has no {part}"
        walked = f"{walked}.{part}"
    return None


def symbols(text: str) -> list[tuple[int, str]]:
    """(line, dotted name) of each of the package's names in `text`'s code spans; file names and config fields
    (`config.json`, `train.max_steps`) are not."""
    modules = {m.name for m in pkgutil.iter_modules(gaudi3_scale.__path__)}
    found = []
    for match in _SYMBOL.finditer(text):
        dotted = match.group(1)
        first = dotted.removeprefix("gaudi3_scale.").split(".")[0]
        if first not in modules or dotted in NOT_SYMBOLS or f"--{dotted}" in FIELDS:
            continue
        if dotted.rsplit(".", 1)[1] in _FILE_SUFFIXES:
            continue
        found.append((text.count("\n", 0, match.start()) + 1, dotted))
    return found


def test_every_python_name_the_pages_give_exists() -> None:
    named = [(page, line, dotted) for page in PAGES for line, dotted in symbols(page.read_text())]
    assert len(named) > 40, len(named)  # the pattern finds them
    wrong = [
        f"{page.relative_to(ROOT).as_posix()}:{line}: `{dotted}`: {problem}"
        for page, line, dotted in named
        if (problem := symbol_problem(dotted))
    ]
    assert not wrong, "\n".join(wrong)


def test_a_wrong_python_name_is_found() -> None:
    assert symbol_problem("health.watchdog.HANG_EXIT_CODE") is None
    assert symbol_problem("gaudi3_scale.forecast.feed.feed_tune_trial") is None
    assert symbol_problem("health.watchdog.HANG_EXIT") == "gaudi3_scale.health.watchdog has no HANG_EXIT"
    assert symbol_problem("health.watchdgo.HANG_EXIT_CODE") == "gaudi3_scale.health has no watchdgo"
    assert [
        d for _, d in symbols("`config.json`, `train.max_steps`, `monitor.perf.mfu()` and `os.path`")
    ] == ["monitor.perf.mfu"]
