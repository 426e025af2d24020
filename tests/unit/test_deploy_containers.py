"""The container files: golden copies, the Dockerfile's structure, its dependency script run for real, checkov."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from gaudi3_scale.deploy.containers import (
    CONFIG_MOUNT,
    CUDA_PYTHON_VERSION,
    GAUDI_BASE,
    IMAGE_UID,
    MODEL_MOUNT,
    SERVE_PORT,
    image_extras,
    render_containers,
)
from gaudi3_scale.deploy.render import CONTAINERS, renderers
from gaudi3_scale.deploy.spec import DeploySpec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "deploy" / "containers"
UPDATE = os.environ.get("GAUDI3_UPDATE_GOLDEN") == "1"  # rewrite the golden files after a deliberate change
# A small fixed run config (not the resolved default: a new config field must not change these files).
RUN_CONFIG: dict[str, Any] = {
    "name": "golden",
    "model": {"name": "shakespeare-char"},
    "parallel": {"strategy": "deepspeed_zero2", "nproc_per_node": 8},
    "monitor": {"metrics_port": 9100, "loggers": "csv,tensorboard"},
    "checkpoint": {"remote_url": "s3://bucket/ckpt"},
}
VARIANTS = {"gaudi3": "gaudi3-scale-train:0.1.0-gaudi", "h100": "gaudi3-scale-train:0.1.0-cuda"}
# checkov Dockerfile checks that fail on purpose, each skipped in the rendered file with this reason: none since
# the inference stage (gaudi3 serve) has a HEALTHCHECK.
CHECKOV_BASELINE: dict[str, str] = {}


def _spec(accelerator: str, run_config: dict[str, Any] | None = None) -> DeploySpec:
    return DeploySpec(target="k8s", accelerator=accelerator, nodes=2, config_path=Path("run.yaml"),
                      run_config=run_config or RUN_CONFIG, name="golden", image=VARIANTS.get(accelerator, "img"))  # fmt: skip


def _dockerfile(accelerator: str) -> str:
    return render_containers(_spec(accelerator))["docker/Dockerfile"]


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
            pending = ""
    return out


def _stages(dockerfile: str) -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for keyword, args in _instructions(dockerfile):
        if keyword == "FROM":
            current = stages.setdefault(args.rsplit(" AS ", 1)[1], [])
        current.append((keyword, args))
    return stages


def _arg_defaults(dockerfile: str) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in _instructions(dockerfile) if k == "ARG" and "=" in a)


@pytest.mark.parametrize("accelerator", sorted(VARIANTS))
def test_rendered_files_match_the_golden_copies(accelerator: str) -> None:
    files = render_containers(_spec(accelerator))
    assert sorted(files) == ["docker/Dockerfile", "docker/Dockerfile.dockerignore", "docker/run.yaml",
                             "metaflow/run.sh"]  # fmt: skip
    for rel, text in files.items():
        golden = GOLDEN / accelerator / rel
        if UPDATE:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.is_file(), f"{golden} missing: run with GAUDI3_UPDATE_GOLDEN=1 once"
        assert text == golden.read_text(), (
            f"{rel} differs from {golden} (GAUDI3_UPDATE_GOLDEN=1 after a deliberate change)"
        )


def test_the_containers_renderer_is_registered() -> None:
    assert renderers()[CONTAINERS] is render_containers


@pytest.mark.parametrize("accelerator", sorted(VARIANTS))
def test_stages_users_entrypoints_and_layer_order(accelerator: str) -> None:
    dockerfile = _dockerfile(accelerator)
    stages = _stages(dockerfile)
    assert list(stages) == ["base", "builder", "train", "inference"]
    keywords = [k for k, _ in _instructions(dockerfile)]
    assert "ADD" not in keywords  # COPY only: no remote URLs or auto-extracted archives
    # Only the server is probed: a training job serves nothing and ends with an exit status.
    assert [stage for stage, lines in stages.items() if "HEALTHCHECK" in dict(lines)] == ["inference"]
    assert f"http://127.0.0.1:{SERVE_PORT}/health" in dict(stages["inference"])["HEALTHCHECK"]
    users = [a for k, a in _instructions(dockerfile) if k == "USER"]
    assert users == [f"{IMAGE_UID}:{IMAGE_UID}"] and IMAGE_UID not in (0, 1000)  # inference inherits train's
    train, inference = dict(stages["train"]), dict(stages["inference"])
    assert json.loads(train["ENTRYPOINT"]) == ["gaudi3"]
    assert json.loads(train["CMD"]) == ["train", "--config", CONFIG_MOUNT]
    assert stages["inference"][0] == ("FROM", "train AS inference")
    assert json.loads(inference["ENTRYPOINT"]) == ["gaudi3", "serve"]
    assert json.loads(inference["CMD"]) == [MODEL_MOUNT, "--host", "0.0.0.0", "--port", str(SERVE_PORT)]
    assert inference["EXPOSE"] == str(SERVE_PORT)
    # Cache order: base sees only the dependency inputs, the source arrives in builder, the wheel in train.
    base_copies = [a for k, a in stages["base"] if k == "COPY"]
    assert base_copies == ["pyproject.toml requirements/constraints.txt /tmp/deps/"]
    base_keywords = [k for k, _ in stages["base"]]
    assert base_keywords.index("COPY") < base_keywords.index("RUN")
    assert ("COPY", "src ./src") in stages["builder"]
    assert any(k == "RUN" and "pip wheel --no-deps" in a for k, a in stages["builder"])
    assert ("COPY", "--from=builder /wheels /tmp/wheels") in stages["train"]
    assert [k for k, _ in stages["train"]].index("USER") > [k for k, _ in stages["train"]].index("RUN")


def test_gaudi_variant_builds_on_intels_image_pinned_and_keeps_its_torch() -> None:
    dockerfile = _dockerfile("gaudi3")
    base_from = dict(_stages(dockerfile)["base"])["FROM"]
    assert base_from == ("vault.habana.ai/gaudi-docker/${GAUDI_SW}/${GAUDI_OS}/habanalabs/"
                         "pytorch-installer-${GAUDI_TORCH}:${GAUDI_TAG} AS base")  # fmt: skip
    args = _arg_defaults(dockerfile)
    assert {k: args[f"GAUDI_{k.upper()}"] for k in GAUDI_BASE} == GAUDI_BASE
    assert args["GAUDI_TAG"] != "latest" and args["GAUDI_TAG"].startswith(args["GAUDI_SW"])
    assert args["GAUDI_OS"] == "ubuntu24.04"  # 22.04's Python 3.10 is older than the package allows
    assert 'LABEL ai.gaudi3-scale.validation="not yet validated on Gaudi hardware"' in dockerfile
    assert "--system-site-packages" in dockerfile and "grep -v '^torch=='" in dockerfile
    assert "python:" not in base_from
    # DeepSpeed on Gaudi is Intel's fork, not PyPI's: not installed from the extra.
    assert args["EXTRAS"] == "deploy,export,monitor,remote,report,tracking"


def test_cuda_variant_is_python_slim_with_pypi_torch() -> None:
    dockerfile = _dockerfile("h100")
    assert dict(_stages(dockerfile)["base"])["FROM"] == "python:${PYTHON_VERSION}-slim AS base"
    args = _arg_defaults(dockerfile)
    assert args["PYTHON_VERSION"] == CUDA_PYTHON_VERSION
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = tuple(int(p) for p in requires.removeprefix(">=").split("."))
    assert tuple(int(p) for p in CUDA_PYTHON_VERSION.split("."))[:2] >= minimum
    assert "vault.habana.ai" not in dockerfile and "grep -v '^torch=='" not in dockerfile
    assert args["EXTRAS"] == "deepspeed,deploy,export,monitor,remote,report,tracking"


def test_every_base_image_tag_is_pinned() -> None:
    for accelerator in VARIANTS:
        dockerfile = _dockerfile(accelerator)
        args = _arg_defaults(dockerfile)
        for keyword, value in _instructions(dockerfile):
            if keyword != "FROM":
                continue
            image = re.sub(r"\$\{(\w+)\}", lambda m, a=args: a[m.group(1)], value.split(" AS ")[0])
            if image in ("base", "train"):
                continue
            assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), image


@pytest.mark.parametrize("accelerator", sorted(VARIANTS))
def test_the_dependency_script_reads_pyproject_for_real(accelerator: str, tmp_path: Path) -> None:
    """The base stage's RUN, run here by sh against the real pyproject.toml and constraints (pip left out)."""
    dockerfile = _dockerfile(accelerator)
    run = next(a for k, a in _stages(dockerfile)["base"] if k == "RUN" and "tomllib" in a)
    script = run.split(" && python -m pip install")[0].split(" && ", 1)[1]  # the pins and requirements lines
    deps = tmp_path / "deps"
    deps.mkdir()
    for rel in ("pyproject.toml", "requirements/constraints.txt"):
        (deps / Path(rel).name).write_bytes((ROOT / rel).read_bytes())
    extras = _arg_defaults(dockerfile)["EXTRAS"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(Path(sys.executable))
    env = {**os.environ, "EXTRAS": extras, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run(["sh", "-c", script.replace("/tmp/deps", str(deps))], check=True, env=env)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [
        r for e in extras.split(",") for r in project["optional-dependencies"][e]
    ]
    assert (deps / "requirements.txt").read_text().splitlines() == wanted
    assert any(r.startswith("metaflow") for r in wanted) and any(r.startswith("torch") for r in wanted)
    pins = (deps / "pins.txt").read_text().splitlines()
    # Intel's torch build is never replaced by PyPI's
    assert ("torch==" in "\n".join(pins)) == (accelerator != "gaudi3")
    assert any(p.startswith("lightning==") for p in pins)


def test_dockerignore_lets_in_exactly_what_the_build_copies() -> None:
    files = render_containers(_spec("h100"))
    ignore = files["docker/Dockerfile.dockerignore"].splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    copied = set()
    for keyword, args in _instructions(files["docker/Dockerfile"]):
        if keyword == "COPY" and not args.startswith("--from"):
            copied |= set(args.split()[:-1])
    assert copied == {"pyproject.toml", "requirements/constraints.txt", "README.md", "src"}
    assert copied <= allowed


def test_image_extras_follow_the_run_config() -> None:
    assert image_extras({}, "h100") == ["deploy", "export", "report"]
    assert image_extras({"monitor": {"loggers": "csv"}}, "h100") == ["deploy", "export", "report"]
    assert image_extras({"monitor": {"loggers": "mlflow"}, "checkpoint": {"remote_url": ""}}, "a100") == [
        "deploy", "export", "report", "tracking"]  # fmt: skip
    assert "deepspeed" in image_extras({"parallel": {"strategy": "deepspeed_zero3"}}, "h200")
    assert "deepspeed" not in image_extras({"parallel": {"strategy": "deepspeed_zero3"}}, "gaudi2")


def _run_launcher(script: str, tmp_path: Path, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Run metaflow/run.sh for real with a `python` that records its argv and environment: (argv, env)."""
    (tmp_path / "metaflow").mkdir(exist_ok=True)
    launcher = tmp_path / "metaflow" / "run.sh"
    launcher.write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "record.json"
    fake = bin_dir / "python"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    subprocess.run(["sh", str(launcher), "--steps", "5"], env={**base, **env}, cwd=tmp_path, check=True)
    done = json.loads(record.read_text())
    return done["argv"], done["env"]


def test_run_config_and_metaflow_launcher(tmp_path: Path) -> None:
    import yaml

    files = render_containers(_spec("gaudi3"))
    # a Gaudi deployment trains on hpu, said in its run config (`auto` would train on the CPU of a node whose
    # Gaudis the runtime did not find)
    assert yaml.safe_load(files["docker/run.yaml"]) == {**RUN_CONFIG, "train": {"device": "hpu"}}
    script = files["metaflow/run.sh"]
    subprocess.run(["sh", "-n", "-c", script], check=True)  # valid shell
    argv, env = _run_launcher(script, tmp_path, {})
    assert argv == ["-m", "gaudi3_scale.deploy.flow", "run", "--config", f"{tmp_path}/metaflow/../docker/run.yaml",
                    "--out", "runs/golden-flow", "--accelerator", "gaudi3", "--steps", "5"]  # fmt: skip
    assert env["GAUDI3_METAFLOW_DEVICES"] == "8" and env["GAUDI3_METAFLOW_ACCELERATOR"] == "gaudi3"
    assert env["METAFLOW_KUBERNETES_CONTAINER_IMAGE"] == VARIANTS["gaudi3"]
    # The environment overrides each of the render's choices.
    overrides = {"GAUDI3_METAFLOW_DEVICES": "2", "GAUDI3_METAFLOW_ACCELERATOR": "h100",
                 "METAFLOW_KUBERNETES_CONTAINER_IMAGE": "other:2"}  # fmt: skip
    argv, env = _run_launcher(script, tmp_path, overrides)
    assert argv[argv.index("--accelerator") + 1] == "h100"
    assert {k: env[k] for k in overrides} == overrides


@pytest.mark.parametrize("accelerator", sorted(VARIANTS))
def test_checkov_passes_but_the_baseline(accelerator: str, tmp_path: Path, checkov: Any) -> None:
    dockerfile = _dockerfile(accelerator)
    (tmp_path / "Dockerfile").write_text(dockerfile)
    report = checkov(tmp_path, framework="dockerfile")
    failed = {c["check_id"]: c["check_name"] for c in report["results"]["failed_checks"]}
    assert not failed
    # The baseline is skipped in the rendered file itself, with its reason (checkov shows it to users too).
    skips = {check: reason.strip() for check, reason in re.findall(r"# checkov:skip=(\w+):(.*)", dockerfile)}
    assert skips == CHECKOV_BASELINE
    assert report["summary"]["skipped"] == len(CHECKOV_BASELINE)
    assert report["summary"]["passed"] >= 10  # the checks really ran
