"""`gaudi3 deploy render --target ci`: the GitHub Actions workflow of a training repository, `.github/workflows/gaudi3.yml`.

Render it into the repository's root (`--out .`): the image it builds is the rendered `docker/Dockerfile`, and the
repro tier trains `docker/run.yaml`, both written beside it by the containers renderer. Jobs, in `needs:` order:

    lint     ruff check + ruff format --check on the repository (ruff at the version gaudi3-scale pins)
    unit     pytest on the repository
    smoke    gaudi3 doctor, then gaudi3 smoke (train, checkpoint, verify, reload, resume)
    repro    gaudi3 doctor, then gaudi3 repro --mode resume on docker/run.yaml: bitwise equal after a resume
    image    after unit: the train image for every platform with BuildKit's GitHub Actions cache, then Trivy on it
    publish  after image, smoke and repro, on pushes to the branch or a v* tag only: the same build, pushed

The tiers run on GitHub's hosted Ubuntu runners with PyPI's CPU torch, unless runner labels are given
(`ci_options.py`): a GPU runner installs PyPI's CUDA torch; a Gaudi runner keeps Intel's torch of its host (a venv
over the system site-packages, torch's pin dropped, as the Gaudi image does; not yet validated on Gaudi hardware).
"""

from __future__ import annotations

import shlex
from typing import Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.deploy.ci_options import PLATFORMS, CiOptions, ci_options, runner_labels
from gaudi3_scale.deploy.node_command import NodeSlots, check_node_config, override_args
from gaudi3_scale.deploy.quoting import comment, yaml_text
from gaudi3_scale.deploy.render import register_renderer
from gaudi3_scale.deploy.spec import DeploySpec

__all__ = ["ACTIONS", "JOBS", "WORKFLOW", "render_ci", "repro_argv"]

WORKFLOW = ".github/workflows/gaudi3.yml"
JOBS = ("lint", "unit", "smoke", "repro", "image", "publish")
# Each action at its major tag (the newest major in each repository's tags, read 2026-07). trivy-action has no major
# tag, and its version tags were force-pushed to malicious commits in March 2026 (GHSA-69fq-xp46-6x23): it is
# pinned by commit, the one tag v0.36.0 names.
ACTIONS = {
    "checkout": "actions/checkout@v7",
    "setup-python": "actions/setup-python@v7",
    "upload-artifact": "actions/upload-artifact@v7",
    "setup-qemu": "docker/setup-qemu-action@v4",
    "setup-buildx": "docker/setup-buildx-action@v4",
    "login": "docker/login-action@v4",
    "metadata": "docker/metadata-action@v6",
    "build-push": "docker/build-push-action@v7",
    "trivy": "aquasecurity/trivy-action@ed142fd0673e97e23eac54620cfb913e5ce36c25",
}
# PyTorch's index of CPU-only wheels: a hosted runner has no GPU, so no CUDA libraries are downloaded for it.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
RUN_CONFIG = "docker/run.yaml"  # written by the containers renderer, beside the workflow
SMOKE_OUT, REPRO_OUT = "runs/ci/smoke", "runs/ci/repro"
_SCAN_TAG = "gaudi3-ci-scan:local"
_GAUDI_NOTE = "Gaudi runner steps: not yet validated on Gaudi hardware."


def render_ci(spec: DeploySpec) -> dict[str, str]:
    opts = ci_options(spec)
    if spec.nodes != 1:
        raise UserInputError(
            f"--nodes: a CI runner is one machine; --target ci takes --nodes 1, got {spec.nodes}"
        )
    _check_repro_config(spec, opts)
    gaudi = spec.accelerator.startswith("gaudi")
    workflow = {
        "name": "gaudi3",
        "on": {
            "push": {"branches": [opts.branch], "tags": ["v*"]},
            "pull_request": None,
            "workflow_dispatch": None,
        },
        # Every job reads the repository, nothing more; publish alone adds what its push needs.
        "permissions": {"contents": "read"},
        "concurrency": {"group": "${{ github.workflow }}-${{ github.ref }}", "cancel-in-progress": True},
        "defaults": {"run": {"shell": "bash"}},
        "jobs": {
            "lint": _lint(opts),
            "unit": _unit(opts),
            "smoke": _smoke(opts, gaudi),
            "repro": _repro(spec, opts, gaudi),
            "image": _image(opts, gaudi),
            "publish": _publish(opts, gaudi),
        },
    }
    return {WORKFLOW: _header(spec, opts, gaudi) + yaml_text(workflow)}


def _header(spec: DeploySpec, opts: CiOptions, gaudi: bool) -> str:
    import dataclasses
    import textwrap

    names = ", ".join(f.name for f in dataclasses.fields(CiOptions))
    lines = [
        f"Rendered by `gaudi3 deploy render --target ci` from {spec.config_path.name} ({spec.accelerator}).",
        "lint -> unit -> smoke -> repro; image (build + Trivy) after unit; publish after all, on pushes only.",
        f"Render into the repository root: the image is built from docker/Dockerfile, repro trains {RUN_CONFIG}.",
        *textwrap.wrap(f"Options (--set KEY=VALUE, docs/deploy_ci.md): {names}.", 110),
    ]
    if gaudi and (opts.smoke_runs_on or opts.repro_runs_on):
        lines.append(_GAUDI_NOTE)
    return "".join(f"# {comment(line)}\n" for line in lines)


def _repro_slots(spec: DeploySpec, opts: CiOptions) -> NodeSlots:
    """The repro runs' overrides: one node of --per-node ranks on its own loopback (a run config file's multi-node
    endpoint would be waited for), on the CPU where a hosted runner stands in for the accelerator the config names,
    then ci.repro_overrides (last: they win)."""
    device = spec.run_config.get("train", {}).get("device", "auto")
    # a hosted runner has no accelerator
    hosted_cpu = not opts.repro_runs_on and device not in ("auto", "cpu")
    extra = [("train.device", "cpu")] if hosted_cpu else []
    extra += [(key, value) for key, _, value in (o.partition("=") for o in opts.repro_overrides)]
    return NodeSlots(node_rank="0", rdzv_endpoint=None, nnodes="1", nproc_per_node=str(spec.per_node),
                     shared_out=True, extra=tuple(extra))  # fmt: skip


def _check_repro_config(spec: DeploySpec, opts: CiOptions) -> None:
    """The repro runs' config (the run config with `_repro_slots`' overrides, as the runner resolves them) must
    resolve: refused here in one line, not on the runner."""
    import copy

    from gaudi3_scale.config.core import apply_overrides
    from gaudi3_scale.config.errors import ConfigError
    from gaudi3_scale.train.config import RunConfig  # no torch behind it

    pairs = [(key, value) for key, _, value in (o.partition("=") for o in opts.repro_overrides)]
    try:  # an unknown or ill-typed key of the option itself: named as the option
        apply_overrides(RunConfig, copy.deepcopy(spec.run_config), pairs)
    except ConfigError as exc:
        raise UserInputError(f"ci.repro_overrides: {exc}") from None
    check_node_config(spec, _repro_slots(spec, opts))


# ---- the tiers ---------------------------------------------------------------------------------------------------


def _checkout(opts: CiOptions) -> dict[str, Any]:
    with_: dict[str, Any] = {"persist-credentials": False}  # no job pushes to git: the token is not kept
    if opts.source != ".":
        with_["submodules"] = "recursive"  # a gaudi3-scale checkout as a submodule
    return {"name": "checkout", "uses": ACTIONS["checkout"], "with": with_}


def _constraints(opts: CiOptions) -> str:
    return f"{opts.source}/requirements/constraints.txt".removeprefix("./")


def _setup_python(opts: CiOptions) -> dict[str, Any]:
    with_ = {
        "python-version": opts.python_version,
        "cache": "pip",
        "cache-dependency-path": _constraints(opts),
    }
    return {"name": "Python", "uses": ACTIONS["setup-python"], "with": with_}


def _install(opts: CiOptions, runner: str, *extra: str) -> list[dict[str, Any]]:
    """Steps that install gaudi3-scale (from the source tree, at its pinned versions) and `extra` packages.
    runner: hosted (PyPI's CPU torch), gpu (PyPI's CUDA torch) or gaudi (the host's torch, kept)."""
    constraints = shlex.quote(_constraints(opts))
    packages = " ".join(shlex.quote(p) for p in (opts.source, *extra))
    if runner == "gaudi":
        script = (
            "python3 -m venv --system-site-packages .venv-gaudi3\n"
            f'grep -v "^torch==" {constraints} > "$RUNNER_TEMP/pins.txt"\n'
            f'.venv-gaudi3/bin/python -m pip install -c "$RUNNER_TEMP/pins.txt" {packages}\n'
            'echo "$PWD/.venv-gaudi3/bin" >> "$GITHUB_PATH"\n'
        )
        return [{"name": "install gaudi3-scale over the host's Intel torch", "run": script}]
    step: dict[str, Any] = {
        "name": "install gaudi3-scale at its pinned versions",
        "run": f"python -m pip install -c {constraints} {packages}",
    }
    if runner == "hosted":
        step["env"] = {"PIP_EXTRA_INDEX_URL": TORCH_CPU_INDEX}
    return [_setup_python(opts), step]


def _runner_kind(labels: str | None, gaudi: bool) -> str:
    if labels is None:
        return "hosted"
    return "gaudi" if gaudi else "gpu"


def _lint(opts: CiOptions) -> dict[str, Any]:
    install = f"python -m pip install -c {shlex.quote(_constraints(opts))} ruff"
    steps = [_checkout(opts), _setup_python(opts), {"name": "install ruff at gaudi3-scale's pin", "run": install},
             {"name": "ruff check", "run": "ruff check ."},
             {"name": "ruff format --check", "run": "ruff format --check ."}]  # fmt: skip
    return {"runs-on": "ubuntu-latest", "timeout-minutes": 10, "steps": steps}


def _unit(opts: CiOptions) -> dict[str, Any]:
    steps = [_checkout(opts), *_install(opts, "hosted", "pytest")]
    if opts.requirements:
        steps.append({"name": "install the repository's requirements",
                      "run": f"python -m pip install -r {shlex.quote(opts.requirements)}",
                      "env": {"PIP_EXTRA_INDEX_URL": TORCH_CPU_INDEX}})  # fmt: skip
    steps.append({"name": "pytest", "run": "python -m pytest -q"})
    return {"needs": ["lint"], "runs-on": "ubuntu-latest", "timeout-minutes": 30, "steps": steps}


def _tier(after: str, labels: str | None, gaudi: bool, opts: CiOptions, timeout_min: int,
          steps: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """A job on `labels`' runner: checkout, install, `gaudi3 doctor` (the runner's environment), then `steps`."""
    setup = [_checkout(opts), *_install(opts, _runner_kind(labels, gaudi)),
             {"name": "gaudi3 doctor", "run": "gaudi3 doctor"}]  # fmt: skip
    return {"needs": [after], "runs-on": runner_labels(labels), "timeout-minutes": timeout_min,
            "steps": setup + steps}  # fmt: skip


def _smoke(opts: CiOptions, gaudi: bool) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [
        {"name": "gaudi3 smoke", "run": shlex.join(["gaudi3", "smoke", "--out", SMOKE_OUT])},
        {"name": "keep the failed run", "if": "failure()", "uses": ACTIONS["upload-artifact"],
         "with": {"name": "smoke-run", "path": SMOKE_OUT, "if-no-files-found": "ignore"}},
    ]  # fmt: skip
    return _tier("unit", opts.smoke_runs_on, gaudi, opts, 20, steps)


def repro_argv(spec: DeploySpec, opts: CiOptions) -> list[str]:
    """The repro tier's command: resume mode on the rendered run config, on one runner with --per-node ranks
    (`_repro_slots`; a config that names cuda or hpu trains on the CPU of a hosted runner, said on its command
    line)."""
    return ["gaudi3", "repro", "--config", RUN_CONFIG, "--mode", "resume", "--steps", str(opts.repro_steps),
            "--out", REPRO_OUT, *override_args(_repro_slots(spec, opts), str)]  # fmt: skip


def _repro(spec: DeploySpec, opts: CiOptions, gaudi: bool) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [
        {"name": "gaudi3 repro (continuous vs resumed, bitwise)", "run": shlex.join(repro_argv(spec, opts))},
        {"name": "keep the report", "if": "always()", "uses": ACTIONS["upload-artifact"],
         "with": {"name": "repro", "path": REPRO_OUT, "if-no-files-found": "ignore"}},
    ]  # fmt: skip
    return _tier("smoke", opts.repro_runs_on, gaudi, opts, 60, steps)


# ---- the image ---------------------------------------------------------------------------------------------------


def _platforms(opts: CiOptions, gaudi: bool) -> str:
    if opts.platforms is not None:
        return ",".join(p.strip() for p in opts.platforms.split(",") if p.strip())
    return "linux/amd64" if gaudi else ",".join(PLATFORMS)


def _cache_scope(gaudi: bool) -> str:
    return f"scope=gaudi3-train-{'gaudi' if gaudi else 'cuda'}"  # one BuildKit cache per Dockerfile flavour


def _build(name: str, opts: CiOptions, gaudi: bool, **with_: Any) -> dict[str, Any]:
    """A build-push-action step of the Dockerfile's train stage, reading the GitHub Actions cache."""
    base = {"context": opts.source, "file": "docker/Dockerfile", "target": "train",
            "platforms": _platforms(opts, gaudi), "cache-from": f"type=gha,{_cache_scope(gaudi)}"}  # fmt: skip
    return {"name": name, "uses": ACTIONS["build-push"], "with": {**base, **with_}}


def _buildx(opts: CiOptions, gaudi: bool) -> list[dict[str, Any]]:
    return [{"name": "QEMU (other platforms' binaries)", "uses": ACTIONS["setup-qemu"],
             "with": {"platforms": _platforms(opts, gaudi)}},
            {"name": "Buildx", "uses": ACTIONS["setup-buildx"]}]  # fmt: skip


def _image(opts: CiOptions, gaudi: bool) -> dict[str, Any]:
    cache_to = f"type=gha,mode=max,{_cache_scope(gaudi)}"  # mode=max: every stage's layers, not only the last
    steps = [
        _checkout(opts),
        *_buildx(opts, gaudi),
        _build("build every platform (fills the cache)", opts, gaudi, push=False, **{"cache-to": cache_to}),
        _build("load the linux/amd64 image to scan (from the cache)", opts, gaudi, platforms="linux/amd64",
               load=True, tags=_SCAN_TAG),
        {"name": "Trivy: fail on fixable CRITICAL / HIGH", "uses": ACTIONS["trivy"],
         "with": {"image-ref": _SCAN_TAG, "severity": "CRITICAL,HIGH", "ignore-unfixed": True,
                  "exit-code": "1", "format": "table"}},
    ]  # fmt: skip
    return {"needs": ["unit"], "runs-on": "ubuntu-latest", "timeout-minutes": 120, "steps": steps}


def _publish(opts: CiOptions, gaudi: bool) -> dict[str, Any]:
    image = (
        f"{opts.registry}/{opts.image_name or '${{ github.repository }}'}"  # metadata-action lower-cases it
    )
    password = f"${{{{ secrets.{opts.registry_password_secret or 'GITHUB_TOKEN'} }}}}"  # a reference, by name
    login = {"name": "registry login", "uses": ACTIONS["login"],
             "with": {"registry": opts.registry, "username": opts.registry_username or "${{ github.actor }}",
                      "password": password}}  # fmt: skip
    tags = "type=ref,event=branch\ntype=semver,pattern={{version}}\ntype=sha\n"
    flavour = f"suffix=-{'gaudi' if gaudi else 'cuda'},onlatest=true\n"
    meta = {"name": "image tags", "id": "meta", "uses": ACTIONS["metadata"],
            "with": {"images": image, "tags": tags, "flavor": flavour}}  # fmt: skip
    push = _build("push every platform (from the cache)", opts, gaudi, push=True,
                  tags="${{ steps.meta.outputs.tags }}", labels="${{ steps.meta.outputs.labels }}",
                  sbom=True, provenance="mode=max")  # fmt: skip
    permissions = {"contents": "read"}
    if opts.registry_password_secret is None:  # GITHUB_TOKEN pushes to ghcr.io with this scope, nothing more
        permissions["packages"] = "write"
    return {
        "needs": ["image", "smoke", "repro"],
        "if": "github.event_name == 'push'",
        "runs-on": "ubuntu-latest",
        "timeout-minutes": 120,
        "permissions": permissions,
        "steps": [_checkout(opts), *_buildx(opts, gaudi), login, meta, push],
    }


register_renderer("ci", render_ci, options=CiOptions)
