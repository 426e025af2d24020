"""`Gaudi3TrainFlow`: a run config's pipeline as a Metaflow flow, start → prepare → tune → train → report → end.

    python -m gaudi3_scale.deploy.flow run --config run.yaml --out runs/my-flow [--tune off|estimate|on]
        [--time-budget-min 30] [--steps N] [--accelerator gaudi3]

(`gaudi3 deploy render` writes `metaflow/run.sh`, which runs exactly this.) Every step but `prepare` runs the
`gaudi3` CLI in a subprocess: the commands a person would type, in the processes the container image runs. The
steps share files through `--out` (prepared data, tuning results, the run directory, the report); the config travels
in Metaflow's datastore (an IncludeFile), and the results come back as artifacts: `summary` (the run's
summary.json), `benchmark_result`, `tune_report` / `best_config`.

Where the steps run:
- locally (the default): Metaflow's local runtime and datastore. Metaflow needs a user name (USERNAME or
  METAFLOW_USER); METAFLOW_HOME / METAFLOW_DATASTORE_SYSROOT_LOCAL move its files.
- on Kubernetes, per step: `GAUDI3_METAFLOW_KUBERNETES=1` adds `@kubernetes` to every step, requesting
  `GAUDI3_METAFLOW_DEVICES` accelerators of kind `GAUDI3_METAFLOW_ACCELERATOR` (habana.ai/gaudi for Gaudi, NVIDIA
  GPUs otherwise) for `tune` (decorators are fixed before Parameters are read, so even an estimate-only tune asks
  for them) and `train`, and nothing special for the others. The image, namespace, CPU, memory and volumes are
  Metaflow's own settings (METAFLOW_KUBERNETES_CONTAINER_IMAGE, …_NAMESPACE, …_CPU, …_MEMORY,
  …_PERSISTENT_VOLUME_CLAIMS); `--out` must be an absolute path on a volume every step mounts. @kubernetes needs an
  S3, GS or Azure datastore (`metaflow configure kubernetes`). Not validated on Gaudi clusters: @kubernetes cannot
  set the hostIPC / SYS_NICE that Intel's example pods use.
- on Kubernetes, all steps alike: Metaflow's own `run --with kubernetes` (no accelerator requests).
The flow trains on one node (one pod) of GAUDI3_METAFLOW_DEVICES ranks (unset: the config's nproc_per_node), on its
own loopback whatever node geometry the config carries (`node_overrides`); multi-node training is the PyTorchJob /
Terraform target of `deploy render`.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # Metaflow starts every task as `python <this file> step …`, so Python puts this directory first on sys.path,
    # where deploy/kubernetes.py would shadow the kubernetes client that Metaflow's @kubernetes imports. The
    # package is imported from its installed location instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import json
import shlex
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

# environment and kubernetes are plugins Metaflow adds to its namespace at import: invisible to mypy.
from metaflow import FlowSpec, IncludeFile, Parameter, environment, kubernetes, step  # type: ignore[attr-defined]

from gaudi3_scale.deploy.node_command import geometry_overrides

__all__ = ["KUBERNETES_ENV", "TUNE_MODES", "Gaudi3TrainFlow", "kubernetes_settings", "node_overrides"]

F = TypeVar("F", bound=Callable[..., Any])
KUBERNETES_ENV = "GAUDI3_METAFLOW_KUBERNETES"
TUNE_MODES = ("off", "estimate", "on")
# Passed on to every step's pod (the pod must build the same decorators when it imports this file).
_FORWARDED = (KUBERNETES_ENV, "GAUDI3_METAFLOW_ACCELERATOR", "GAUDI3_METAFLOW_DEVICES")
GAUDI_RESOURCE = "habana.ai/gaudi"  # the Gaudi device plugin's extended resource (docs.habana.ai)


def kubernetes_settings(accelerated: bool, env: Mapping[str, str]) -> dict[str, Any]:
    """@kubernetes keyword arguments for a step: accelerators for `accelerated` steps, Metaflow's defaults else."""
    if not accelerated:
        return {}
    accelerator = env.get("GAUDI3_METAFLOW_ACCELERATOR", "")
    devices = _devices(env)
    if accelerator.startswith("gaudi"):
        return {"extended_resources": {GAUDI_RESOURCE: devices}}
    return {"gpu": int(devices), "gpu_vendor": "nvidia"}


def _devices(env: Mapping[str, str]) -> str:
    """The accelerators of the flow's pod, which are also the ranks its steps train: GAUDI3_METAFLOW_DEVICES
    (`metaflow/run.sh` exports the deployment's), else 1. One default for both, so a pod never starts more ranks
    than it was given devices."""
    devices = env.get("GAUDI3_METAFLOW_DEVICES", "1")
    if not devices.isdigit() or int(devices) < 1:
        raise ValueError(f"GAUDI3_METAFLOW_DEVICES: expected a positive whole number, got {devices!r}")
    return devices


def node_overrides(env: Mapping[str, str]) -> list[str]:
    """The geometry the tune and train steps run: one node (the flow's pod) on its own loopback, with
    as many ranks as the pod asked for accelerators (`_devices`)."""
    pairs = geometry_overrides(
        nnodes="1",
        nproc_per_node=_devices(env),
        node_rank="0",
        rdzv_endpoint=None,
    )
    return [f"--{key}={value}" for key, value in pairs]


def _on_kubernetes(*, accelerated: bool = False) -> Callable[[F], F]:
    """@kubernetes (+ @environment forwarding the switch) when GAUDI3_METAFLOW_KUBERNETES=1; else no change."""
    if os.environ.get(KUBERNETES_ENV) != "1":
        return lambda f: f
    forwarded = {name: os.environ[name] for name in _FORWARDED if name in os.environ}
    # The image has the `deploy` extra (metaflow, boto3, requests): no pip installs at pod start, which as the
    # image's non-root user could not write to its virtualenv anyway.
    forwarded["METAFLOW_SKIP_INSTALL_DEPENDENCIES"] = "1"
    settings = kubernetes_settings(accelerated, os.environ)

    def apply(f: F) -> F:
        return kubernetes(**settings)(environment(vars=forwarded)(f))

    return apply


def _gaudi3(*args: str, capture: bool = False) -> str:
    """Run `gaudi3 ARGS…` with this interpreter; its output goes to the task log (and is returned if `capture`)."""
    command = [sys.executable, "-m", "gaudi3_scale.cli", *args]
    print("$ gaudi3 " + shlex.join(args), flush=True)
    result = subprocess.run(command, capture_output=capture, text=True)
    if capture:
        print(result.stdout, end="", flush=True)
        print(result.stderr, end="", file=sys.stderr, flush=True)
    if result.returncode != 0:
        raise RuntimeError(f"`gaudi3 {shlex.join(args)}` failed with exit code {result.returncode}")
    return result.stdout if capture else ""


class Gaudi3TrainFlow(FlowSpec):
    """Prepare the data, tune (optionally), train and report one run config."""

    # Typed Any: on a running flow Metaflow replaces each of these by its value (text, str, float, int).
    config: Any = IncludeFile(
        "config", required=True, is_text=True, help="run config YAML (gaudi3 train --config)"
    )
    out: Any = Parameter(
        "out", required=True, help="output directory shared by the steps (absolute on Kubernetes)"
    )
    tune_mode: Any = Parameter(
        "tune",
        default="estimate",
        help="off: train the config as it is; estimate: print the memory estimate table (runs nothing); "
        "on: run `gaudi3 tune` and train its best.yaml",
    )
    time_budget_min: Any = Parameter(
        "time-budget-min",
        type=float,
        default=10.0,
        help="with --tune on: start no trial after this many minutes",
    )
    steps: Any = Parameter(
        "steps", type=int, default=0, help="train.max_steps override; 0 keeps the config's"
    )
    accelerator: Any = Parameter(
        "accelerator",
        default="",
        help="the device the estimate table checks (e.g. gaudi3, h100); '' = budget",
    )

    def _config_file(self) -> Path:
        """The run config as a file under --out (written by whichever step needs it first; same text each time)."""
        path = Path(self.out_dir) / "flow" / "run.yaml"
        if not path.is_file() or path.read_text() != self.config:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.config)
        return path

    @_on_kubernetes()
    @step
    def start(self) -> None:
        if self.tune_mode not in TUNE_MODES:
            raise ValueError(f"--tune: must be one of {', '.join(TUNE_MODES)}, got {self.tune_mode!r}")
        if self.steps < 0:
            raise ValueError(f"--steps: must be 0 (the config's) or positive, got {self.steps}")
        self.out_dir = str(Path(self.out).absolute())
        self.next(self.prepare)

    @_on_kubernetes()
    @step
    def prepare(self) -> None:
        """Tokenize the config's data source into OUT/data (what `gaudi3 prepare` does, with every data.* field)."""
        from gaudi3_scale.config.core import parse_overrides
        from gaudi3_scale.data import load_manifest, prepare_dataset
        from gaudi3_scale.train.config import build_run_config

        cfg = build_run_config(self._config_file(), parse_overrides(self._overrides()))
        data_dir = prepare_dataset(cfg.data, Path(self.out_dir) / "data", progress=False)
        manifest = load_manifest(data_dir)
        self.data_dir = str(data_dir)
        self.data_tokens = dict(manifest.num_tokens)
        print(f"prepared {data_dir}: {manifest.num_tokens} tokens, vocabulary {manifest.vocab_size}")
        self.next(self.tune)

    @_on_kubernetes(accelerated=True)
    @step
    def tune(self) -> None:
        config = str(self._config_file())
        self.train_config = config
        self.tune_report = ""
        self.best_config = None
        if self.tune_mode == "estimate":
            accelerator = ["--accelerator", self.accelerator] if self.accelerator else []
            self.tune_report = _gaudi3(
                "tune", "--config", config, "--estimate-only", *accelerator, capture=True
            )
        elif self.tune_mode == "on":
            out = Path(self.out_dir) / "tune"
            self.tune_report = _gaudi3(
                "tune", "--config", config, "--time-budget-min", f"{self.time_budget_min:g}", "--out", str(out),
                *self._overrides(), capture=True,
            )  # fmt: skip
            self.train_config = str(out / "best.yaml")
            self.best_config = (out / "best.yaml").read_text()
        self.next(self.train)

    @_on_kubernetes(accelerated=True)
    @step
    def train(self) -> None:
        """`gaudi3 train` on the prepared data; resumes from OUT/run's checkpoints when the step is retried."""
        self.run_dir = str(Path(self.out_dir) / "run")
        _gaudi3(
            "train", "--config", self.train_config, "--out", self.run_dir, "--no-progress", "--sample-tokens", "0",
            "--data.prepared_dir", self.data_dir, "--benchmark.result", "true", *node_overrides(os.environ),
            *self._overrides(),
        )  # fmt: skip
        run = Path(self.run_dir)
        self.summary = json.loads((run / "summary.json").read_text())
        self.benchmark_result = json.loads((run / "benchmark_result.json").read_text())
        self.next(self.report)

    @_on_kubernetes()
    @step
    def report(self) -> None:
        """The `gaudi3 benchmark report` of this run: Markdown, HTML, CSV and plots in OUT/report."""
        report_dir = Path(self.out_dir) / "report"
        _gaudi3("benchmark", "report", self.run_dir, "--out", str(report_dir), "--label", "flow")
        self.report_files = sorted(p.name for p in report_dir.iterdir())
        self.next(self.end)

    @_on_kubernetes()
    @step
    def end(self) -> None:
        s = self.summary
        val = f"{s['val_loss']:.4f}" if s.get("val_loss") is not None else "none"
        print(f"trained {s['steps']} steps: train loss {s['train_loss']:.4f}, val loss {val}, "
              f"{s['tokens_per_s']:.0f} tokens/s; report in {self.out_dir}/report")  # fmt: skip

    def _overrides(self) -> list[str]:
        # A length in steps replaces one in epochs (a config setting both is refused).
        return ["--train.max_steps", str(self.steps), "--train.max_epochs", "null"] if self.steps else []


if __name__ == "__main__":
    Gaudi3TrainFlow()
