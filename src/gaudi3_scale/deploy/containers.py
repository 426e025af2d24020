"""The container files every target ships: one multi-stage Dockerfile and its ignore file under `docker/`, and the
Metaflow launcher under `metaflow/` (the flow's steps run the same image).

Stages, in cache order (what changes least comes first, so a source edit rebuilds only the last layers):

    base       Python + the package's pinned dependencies (pyproject.toml's list, requirements/constraints.txt's
               versions) + the non-root user
    builder    the gaudi3-scale wheel, built from the source tree
    train      base + the wheel; ENTRYPOINT gaudi3, CMD train --config /etc/gaudi3/run.yaml
    inference  train with ENTRYPOINT gaudi3 serve: the OpenAI-compatible server on port 8000 (all interfaces inside
               the container), serving the export or checkpoint mounted at /models/model; for production-scale
               serving of a `--format hf` export, vLLM or TGI (docs/serving.md)

The base follows the accelerator: Gaudi → Intel's PyTorch image (its own torch build, which must not be replaced
by PyPI's); NVIDIA → `python:<version>-slim` + PyPI's torch wheel, which is built against CUDA and pulls the CUDA
libraries it needs as pip packages (nvidia-*), so an `nvidia/cuda` base would only ship a second copy of them; the
driver comes from the host through the NVIDIA container toolkit.
"""

from __future__ import annotations

from typing import Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.deploy.quoting import comment, dockerfile_exec, sh_quote, yaml_text
from gaudi3_scale.deploy.render import CONTAINERS, register_renderer
from gaudi3_scale.deploy.spec import BUCKET_SCHEMES, DeploySpec, storage_urls
from gaudi3_scale.verify.doctor import BEFORE_TRAIN_ENV, SKIP_ENV

__all__ = [
    "CONFIG_MOUNT",
    "CUDA_PYTHON_VERSION",
    "GAUDI_BASE",
    "IMAGE_UID",
    "MODEL_MOUNT",
    "SERVE_PORT",
    "image_extras",
    "render_containers",
]

CONFIG_MOUNT = (
    "/etc/gaudi3/run.yaml"  # where the run config is mounted (ConfigMap, `docker run -v`, Ansible copy)
)
MODEL_MOUNT = "/models/model"  # the inference stage serves what is mounted here (an export or a checkpoint)
SERVE_PORT = 8000
IMAGE_UID = (
    10001  # not 1000: Ubuntu 24.04 images (Intel's Gaudi base among them) already have uid 1000 `ubuntu`
)
# python:3.11.15-slim is a published tag (Docker Hub); 3.11 is the oldest Python the package supports.
CUDA_PYTHON_VERSION = "3.11.15"
# Intel's image path is vault.habana.ai/gaudi-docker/<SW>/<os>/habanalabs/pytorch-installer-<torch>:<tag>
# (docs.habana.ai quick start). Intel's docs show `:latest`; build-number tags such as
# 1.24.0-1007 are published too (seen pulled by Gaudi users), so the default is pinned and `:latest` is one
# --build-arg away. Ubuntu 24.04, not 22.04: the 22.04 images ship Python 3.10 and the package needs >= 3.11.
GAUDI_BASE = {"sw": "1.24.0", "os": "ubuntu24.04", "torch": "2.10.0", "tag": "1.24.0-1007"}
NOT_VALIDATED = "not yet validated on Gaudi hardware"
# Extras every image carries: the Metaflow flow's steps run in it (metaflow, which brings boto3 + requests for an
# S3 datastore) and its report step writes a benchmark report (pandas); the inference stage loads safetensors exports.
_ALWAYS = ("deploy", "export", "report")
# Each extra's fsspec backend and the schemes it serves (the backend's own `protocol` tuple: s3fs ("s3", "s3a"),
# gcsfs ("gs", "gcs"), adlfs ("abfs", "az", "abfss") and its Gen1 AzureDatalakeFileSystem ("adl")); a node that
# opens such a URL without the extra stops at start (exit 2, not restarted). None: the base dependencies hold it
# (lightning requires fsspec[http], which brings aiohttp: file://, memory://, http(s)://; tokenizers requires
# huggingface_hub, whose HfFileSystem is fsspec's hf://).
_EXTRA_SCHEMES: dict[str | None, tuple[str, ...]] = {
    "remote": ("s3", "s3a"),
    "gcs": ("gs", "gcs"),
    "azure": ("az", "abfs", "abfss", "adl"),
    None: ("file", "memory", "http", "https", "hf"),
}
SCHEME_EXTRAS: dict[str, str | None] = {
    scheme: extra for extra, schemes in _EXTRA_SCHEMES.items() for scheme in schemes
}


def image_extras(run_config: dict[str, Any], accelerator: str, target: str | None = None) -> list[str]:
    """The package extras the run config needs at run time, plus the ones the flow needs: among them the fsspec
    backend of every storage URL the nodes open, the run config's (`spec.storage_urls`) and the checkpoint bucket
    a cloud `target` creates. A URL whose backend no extra holds is refused in one line."""
    extras = list(_ALWAYS)
    monitor = run_config.get("monitor", {})
    if monitor.get("metrics_port") is not None:
        extras.append("monitor")
    urls = storage_urls(run_config)
    if target in BUCKET_SCHEMES:
        urls.append((f"the {target} checkpoint bucket", f"{BUCKET_SCHEMES[target]}://bucket"))
    for name, url in urls:
        scheme = url.partition("://")[0].lower()
        if scheme not in SCHEME_EXTRAS:
            raise UserInputError(
                f"{name}: {scheme}:// has no backend in the rendered image; allowed schemes: "
                f"{', '.join(sorted(SCHEME_EXTRAS))}"
            )
        if (extra := SCHEME_EXTRAS[scheme]) is not None:
            extras.append(extra)
    loggers = {n.strip().lower() for n in str(monitor.get("loggers") or "").split(",")}
    if loggers & {"tensorboard", "mlflow"}:
        extras.append("tracking")
    if run_config.get("train", {}).get("precision") == "fp8":
        extras.append("fp8")
    # DeepSpeed on Gaudi is Intel's fork (HabanaAI/DeepSpeed@<SW version>), not PyPI's: left to the user there.
    strategy = str(run_config.get("parallel", {}).get("strategy", ""))
    if strategy.startswith("deepspeed") and not accelerator.startswith("gaudi"):
        extras.append("deepspeed")
    return sorted(set(extras))


def _header(spec: DeploySpec, gaudi: bool) -> str:
    base = "Intel's Gaudi PyTorch image" if gaudi else "python slim + PyPI's CUDA torch wheel"
    image = sh_quote(spec.image)  # the comments show commands to copy into a shell
    lines = [
        "syntax=docker/dockerfile:1",
        f"gaudi3-scale images for run {spec.name!r} on {spec.accelerator} ({base}).",
        "Build from a gaudi3-scale source checkout (the build context); this file's directory holds its ignore file:",
        f"  docker build -f docker/Dockerfile --target train -t {image} <gaudi3-scale checkout>",
        "  docker build -f docker/Dockerfile --target inference -t <name>-inference <gaudi3-scale checkout>",
        f"The run config (docker/run.yaml here) is mounted at {CONFIG_MOUNT} (a ConfigMap on Kubernetes), not baked in:",
        f"  docker run{'' if gaudi else ' --gpus all'} -v $PWD/docker/run.yaml:{CONFIG_MOUNT}:ro "
        f"-v $PWD/runs:/workspace/runs {image}",
        f"The inference image serves an export (gaudi3 ckpt export) mounted at {MODEL_MOUNT}:",
        f"  docker run -p {SERVE_PORT}:{SERVE_PORT} -v $PWD/export:{MODEL_MOUNT}:ro <name>-inference",
    ]
    if gaudi:
        lines += [
            f"The Gaudi variant is {NOT_VALIDATED}. Run it with Habana's runtime, e.g. `--runtime=habana",
            "-e HABANA_VISIBLE_DEVICES=all --cap-add=sys_nice --ipc=host`; whether the non-root user can open the",
            "devices depends on the host's device permissions. sys_nice (Habana's example) has no effect for that",
            f"non-root user (UID {IMAGE_UID}: Docker sets no ambient capabilities); whether Gaudi training needs it",
            "is not validated on Gaudi hardware.",
        ]
    return "".join(f"# {comment(line)}\n" for line in lines)


def _base_stage(gaudi: bool, extras: list[str]) -> str:
    if gaudi:
        args = "\n".join(f"ARG GAUDI_{key.upper()}={value}" for key, value in GAUDI_BASE.items())
        source = (
            f"{args}\n"
            "FROM vault.habana.ai/gaudi-docker/${GAUDI_SW}/${GAUDI_OS}/habanalabs/"
            "pytorch-installer-${GAUDI_TORCH}:${GAUDI_TAG} AS base\n"
            f'LABEL ai.gaudi3-scale.validation="{NOT_VALIDATED}"\n'
        )
        # The venv sees the system site-packages, where Intel's torch build lives; torch's PyPI pin is dropped so
        # pip never replaces that build (lightning's `torch>=…` is satisfied by it). --without-pip: Ubuntu's python3
        # may lack ensurepip (python3-venv); the system pip, run by the venv's python, installs into the venv.
        venv = "python3 -m venv --without-pip --system-site-packages /opt/venv"
        constraints = "grep -v '^torch==' /tmp/deps/constraints.txt > /tmp/deps/pins.txt"
    else:
        source = f"ARG PYTHON_VERSION={CUDA_PYTHON_VERSION}\nFROM python:${{PYTHON_VERSION}}-slim AS base\n"
        venv = "python3 -m venv /opt/venv"
        constraints = "cp /tmp/deps/constraints.txt /tmp/deps/pins.txt"
    # The dependency list is read from pyproject.toml at build time (its one home); the versions come from the
    # constraints file. Only these two files are copied here, so editing the source keeps this layer cached.
    read_deps = (
        "python -c \"import sys, tomllib; p = tomllib.load(open('/tmp/deps/pyproject.toml', 'rb'))['project']; "
        "extra = p['optional-dependencies']; "
        "print(*p['dependencies'], *(r for e in sys.argv[1].split(',') if e for r in extra[e]), sep=chr(10))\" "
        '"$EXTRAS" > /tmp/deps/requirements.txt'
    )
    return (
        f"{source}"
        'LABEL org.opencontainers.image.title="gaudi3-scale"\n'
        f"ARG EXTRAS={','.join(extras)}\n"
        "ENV VIRTUAL_ENV=/opt/venv \\\n"
        "    PATH=/opt/venv/bin:$PATH \\\n"
        "    PIP_NO_CACHE_DIR=1 \\\n"
        "    PIP_DISABLE_PIP_VERSION_CHECK=1 \\\n"
        "    PYTHONUNBUFFERED=1\n"
        "COPY pyproject.toml requirements/constraints.txt /tmp/deps/\n"
        f"RUN {venv} \\\n"
        f" && {constraints} \\\n"
        f" && {read_deps} \\\n"
        " && python -m pip install -c /tmp/deps/pins.txt -r /tmp/deps/requirements.txt \\\n"
        " && rm -rf /tmp/deps\n"
        f"RUN groupadd --gid {IMAGE_UID} gaudi3 \\\n"
        f" && useradd --uid {IMAGE_UID} --gid {IMAGE_UID} --create-home --shell /bin/bash gaudi3 \\\n"
        f" && mkdir -p /workspace {CONFIG_MOUNT.rsplit('/', 1)[0]} \\\n"
        f" && chown {IMAGE_UID}:{IMAGE_UID} /workspace\n"
    )


_HEALTH_PROBE = (
    f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{SERVE_PORT}/health', timeout=4)"
)
_LATER_STAGES = f"""
# ---- builder: the wheel, from the source tree (only this stage and the next see src/) ----
FROM base AS builder
WORKDIR /build
COPY pyproject.toml README.md ./
COPY src ./src
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

# ---- train: ENTRYPOINT gaudi3; the config comes from {CONFIG_MOUNT} ----
FROM base AS train
COPY --from=builder /wheels /tmp/wheels
RUN python -m pip install --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels
WORKDIR /workspace
# `gaudi3 train` runs `gaudi3 doctor` before any rank starts and stops on a FAIL (docs/doctor.md), whatever the
# entrypoint (Kubernetes and the node scripts call gaudi3 directly); {SKIP_ENV}=1 skips it in an emergency
ENV {BEFORE_TRAIN_ENV}=1
USER {IMAGE_UID}:{IMAGE_UID}
# No HEALTHCHECK for training: a job serves nothing to probe and ends with an exit status (the inference stage has one)
ENTRYPOINT {dockerfile_exec(["gaudi3"])}
CMD {dockerfile_exec(["train", "--config", CONFIG_MOUNT])}

# ---- inference: `gaudi3 serve` (OpenAI /v1/completions) on an export or checkpoint mounted at {MODEL_MOUNT} ----
FROM train AS inference
EXPOSE {SERVE_PORT}
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \\
  CMD {dockerfile_exec(["python", "-c", _HEALTH_PROBE])}
ENTRYPOINT {dockerfile_exec(["gaudi3", "serve"])}
CMD {dockerfile_exec([MODEL_MOUNT, "--host", "0.0.0.0", "--port", str(SERVE_PORT)])}
"""


def render_dockerfile(spec: DeploySpec) -> str:
    gaudi = spec.accelerator.startswith("gaudi")
    extras = image_extras(spec.run_config, spec.accelerator, spec.target)
    stage = (
        "# ---- base: Python + pinned dependencies + the non-root user (changes only when the pins do) ----\n"
    )
    return _header(spec, gaudi) + "\n" + stage + _base_stage(gaudi, extras) + _LATER_STAGES


# Only what the build reads (pyproject.toml, README.md, requirements/constraints.txt, src/) goes into the context.
DOCKERIGNORE = """\
# BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile given with -f; the context is a source checkout.
*
!pyproject.toml
!README.md
!requirements/constraints.txt
!src/
**/__pycache__
**/*.pyc
**/*.egg-info
"""


def render_metaflow(spec: DeploySpec) -> dict[str, str]:
    out = f"runs/{spec.name}-flow"
    # This render's choices are shell words of their own (sh_quote), then used as "$name": no value is ever
    # spliced into shell syntax.
    choices = {
        "accelerator": spec.accelerator,
        "devices": str(spec.per_node),
        "image": spec.image,
        "out": out,
    }
    lines = [
        f"Run {spec.name}'s pipeline (prepare → tune → train → report) with Metaflow: gaudi3_scale.deploy.flow.",
        "  locally:        sh metaflow/run.sh [--tune on --time-budget-min 30] [--steps N]",
        f"  on Kubernetes:  GAUDI3_METAFLOW_KUBERNETES=1 sh metaflow/run.sh --out {sh_quote(f'/mnt/shared/{spec.name}-flow')}",
        "Kubernetes needs a Metaflow S3/GS/Azure datastore (`metaflow configure kubernetes`), and --out on a "
        "volume every",
        """step's pod mounts (METAFLOW_KUBERNETES_PERSISTENT_VOLUME_CLAIMS='{"claim": "/mnt/shared"}').""",
        "Metaflow needs a user name: USERNAME or METAFLOW_USER.",
    ]
    if spec.accelerator.startswith("gaudi"):
        lines.append(
            f"{spec.accelerator}: the flow's Gaudi steps (habana.ai/gaudi devices, hpu) are {NOT_VALIDATED}."
        )
    script = (
        "#!/bin/sh\n" + "".join(f"# {comment(line)}\n" for line in lines) + "set -eu\n"
        'here=$(cd "$(dirname "$0")" && pwd)\n'
        "# This render's choices; GAUDI3_METAFLOW_ACCELERATOR, GAUDI3_METAFLOW_DEVICES and\n"
        "# METAFLOW_KUBERNETES_CONTAINER_IMAGE in the environment override the first three.\n"
        + " ".join(f"{name}={sh_quote(value)}" for name, value in choices.items())
        + "\n"
        'export GAUDI3_METAFLOW_ACCELERATOR="${GAUDI3_METAFLOW_ACCELERATOR:-$accelerator}"\n'
        'export GAUDI3_METAFLOW_DEVICES="${GAUDI3_METAFLOW_DEVICES:-$devices}"\n'
        'export METAFLOW_KUBERNETES_CONTAINER_IMAGE="${METAFLOW_KUBERNETES_CONTAINER_IMAGE:-$image}"\n'
        'exec python -m gaudi3_scale.deploy.flow run --config "$here/../docker/run.yaml" --out "$out" \\\n'
        '  --accelerator "$GAUDI3_METAFLOW_ACCELERATOR" "$@"\n'
    )
    return {"metaflow/run.sh": script}


def render_containers(spec: DeploySpec) -> dict[str, str]:
    config = (
        f"# The run config the images train with (resolved by `gaudi3 deploy render`), for {CONFIG_MOUNT}.\n"
    )
    return {
        "docker/Dockerfile": render_dockerfile(spec),
        "docker/Dockerfile.dockerignore": DOCKERIGNORE,
        "docker/run.yaml": config + yaml_text(spec.run_config),
        **render_metaflow(spec),
    }


register_renderer(CONTAINERS, render_containers)
