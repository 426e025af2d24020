"""`gaudi3 deploy …` through the CLI: bad input, render refusals, and plan / apply / destroy against stand-in
terraform / kubectl programs that record how they were called (what really runs on our side is tested for real)."""

from __future__ import annotations

import io
import json
import re
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from gaudi3_scale.bench.result import cell_section, print_result, result_from_metrics
from gaudi3_scale.cli.main import cli
from gaudi3_scale.deploy.grammar import RUN_NAME
from gaudi3_scale.deploy.render import RECORD_DIR
from gaudi3_scale.distributed.plan import BatchPlan
from render_targets import TARGET_FLAGS

Cli = Callable[..., tuple[int, str, str]]
BIN = Path(sys.executable).parent
CONFIG = "name: deploy-cli\nmodel: {name: shakespeare-char, num_layers: 1}\ntrain: {max_steps: 10, global_batch_size: 32}\n"
EXPECTED = {
    "render": ["--accelerator", "--config", "--force", "--hosts", "--image", "--nodes", "--out", "--per-node",
               "--region", "--set", "--target"],
    "collect": ["--job", "--namespace", "--out"],
    "plan": [],
    "apply": ["--yes"],
    "destroy": ["--yes"],
}  # fmt: skip
FAKE_TOOL = """\
#!{python}
# Stand-in for {tool}: appends [cwd, argv] to $FAKE_TOOL_LOG, prints the file $FAKE_STDOUT_<SUBCOMMAND> names,
# exits with $FAKE_EXIT_<SUBCOMMAND> (default 0).
import json, os, sys
with open(os.environ["FAKE_TOOL_LOG"], "a") as log:
    log.write(json.dumps([os.getcwd(), [os.path.basename(sys.argv[0]), *sys.argv[1:]]]) + "\\n")
if os.environ.get("FAKE_STDOUT_" + sys.argv[1].upper()):  # a file whose text to print
    sys.stdout.write(open(os.environ["FAKE_STDOUT_" + sys.argv[1].upper()]).read())
sys.exit(int(os.environ.get("FAKE_EXIT_" + sys.argv[1].upper(), "0")))
"""


def _one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (code, out, err)
    assert err.startswith("gaudi3: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[tuple[str, list[str]]]]:
    """terraform and kubectl stand-ins alone on PATH; returns a reader of their calls as (cwd, argv)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for tool in ("terraform", "kubectl"):
        path = bin_dir / tool
        path.write_text(FAKE_TOOL.format(python=sys.executable, tool=tool))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_TOOL_LOG", str(log))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # not a terminal: nobody to ask

    def calls() -> list[tuple[str, list[str]]]:
        if not log.exists():
            return []
        return [tuple(json.loads(line)) for line in log.read_text().splitlines()]  # type: ignore[misc]

    return calls


@pytest.fixture
def terraform_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "out" / "terraform"
    directory.mkdir(parents=True)
    (directory / "main.tf").write_text('terraform {\n  required_version = ">= 1.5"\n}\n')
    (tmp_path / "out" / "docker").mkdir()
    (tmp_path / "out" / "docker" / "run.yaml").write_text(CONFIG)  # not a manifest: ignored
    return directory


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    directory = tmp_path / "k8s"
    (directory / "base").mkdir(parents=True)
    (directory / "base" / "00-namespace.yaml").write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: t}\n"
    )
    (directory / "job.yaml").write_text(
        textwrap.dedent("""\
        apiVersion: v1
        kind: Service
        metadata: {name: t, namespace: t}
        ---
        apiVersion: batch/v1
        kind: Job
        metadata: {name: t, namespace: t}
        """)
    )
    (directory / "run.yaml").write_text(CONFIG)  # YAML but not a manifest
    return directory


def test_deploy_subcommands_are_pinned() -> None:
    group = cli.commands["deploy"]
    assert isinstance(group, click.Group)
    assert sorted(group.commands) == sorted(EXPECTED)
    for name, options in EXPECTED.items():
        params = group.commands[name].params
        names = [o for p in params if isinstance(p, click.Option) for o in p.opts if o.startswith("--")]
        assert sorted(n for n in names if n != "--help") == sorted(options), name


def test_gaudi3_deploy_console_script() -> None:
    out = subprocess.run(
        [str(BIN / "gaudi3-deploy"), "plan", "/nonexistent/dir"], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stderr.startswith("gaudi3: error: /nonexistent/dir: no such file"), out


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["--target", "mars", "--accelerator", "h100", "--nodes", "1"],
            ["--target", "aws, azure, gcp", "'mars'"],
        ),
        (["--target", "k8s", "--accelerator", "tpu9", "--nodes", "1"], ["--accelerator", "gaudi3", "'tpu9'"]),
        (["--target", "k8s", "--accelerator", "h100", "--nodes", "0"], ["--nodes", "positive", "0"]),
        (["--target", "k8s", "--accelerator", "h100", "--nodes", "-3"], ["--nodes", "positive"]),
    ],
)
def test_render_bad_input_is_one_line(
    gaudi3_cli: Cli, config: Path, tmp_path: Path, args: list[str], needles: list[str]
) -> None:
    code, out, err = gaudi3_cli(
        "deploy", "render", *args, "--config", str(config), "--out", str(tmp_path / "o")
    )
    _one_line_error(code, out, err, *needles)
    assert not (tmp_path / "o").exists()


def test_set_options_reach_the_kubernetes_renderer_and_other_targets_refuse_them(
    gaudi3_cli: Cli, config: Path, tmp_path: Path
) -> None:
    base = ["deploy", "render", "--accelerator", "h100", "--nodes", "2", "--config", str(config)]
    code, out, err = gaudi3_cli(*base, "--target", "k8s", "--out", str(tmp_path / "k"),
                                "--set", "namespace=team-a", "--set", "max_restarts=5")  # fmt: skip
    assert code == 0, err
    manifests = "".join(p.read_text() for p in (tmp_path / "k" / "k8s").rglob("*.yaml"))
    assert "namespace: team-a" in manifests and "--parallel.max_restarts=5" in manifests
    code, out, err = gaudi3_cli(*base, "--target", "k8s", "--out", str(tmp_path / "k2"), "--set", "nope=1")
    _one_line_error(code, out, err, "k8s.nope", "unknown field")
    code, out, err = gaudi3_cli(
        *base, "--target", "aws", "--out", str(tmp_path / "a"), "--set", "namespace=x"
    )
    _one_line_error(code, out, err, "--set", "--target aws takes no options")
    code, out, err = gaudi3_cli(*base, "--target", "k8s", "--out", str(tmp_path / "k3"), "--set", "novalue")
    _one_line_error(code, out, err, "--set", "KEY=VALUE")
    assert not (tmp_path / "a").exists() and not (tmp_path / "k2").exists()


@pytest.mark.parametrize("target", ["aws", "azure", "gcp"])
def test_cloud_nodes_keep_out_on_their_own_disks_so_sharded_checkpoints_over_nodes_are_refused(
    gaudi3_cli: Cli, config: Path, tmp_path: Path, target: str
) -> None:
    """Each VM keeps --out on its own disk (rank 0 mirrors the checkpoints to the bucket): FSDP over 2 nodes would
    be refused by the run itself (`train.nodes`), so it is refused here, before anything is rendered or paid for."""
    args = ["deploy", "render", "--target", target, "--accelerator", "h100", "--config", str(config)]
    fsdp = tmp_path / "fsdp.yaml"
    fsdp.write_text(config.read_text() + "parallel:\n  strategy: fsdp\n")
    code, out, err = gaudi3_cli(*args[:-1], str(fsdp), "--nodes", "2", "--out", str(tmp_path / "o"))
    _one_line_error(code, out, err, f"--target {target}: each node keeps the run's --out on its own disk",
                    "with parallel.strategy fsdp every rank writes its part", "use --target k8s")  # fmt: skip
    assert not (tmp_path / "o").exists()
    for nodes, path in (("1", fsdp), ("2", config)):  # one node; or rank 0 alone writes the checkpoints
        code, out, err = gaudi3_cli(
            *args[:-1], str(path), "--nodes", nodes, "--out", str(tmp_path / f"ok{nodes}")
        )
        assert code == 0, err


@pytest.mark.parametrize("target", ["k8s", "aws"])
def test_a_run_in_epochs_renders_and_its_rendered_config_reads_back(
    gaudi3_cli: Cli, tmp_path: Path, target: str
) -> None:
    """The rendered run config holds max_steps null beside max_epochs (its resolved value is a placeholder), which
    the render's own check of the nodes' config must read as `gaudi3 train --config` does."""
    config = tmp_path / "epochs.yaml"
    config.write_text(
        "name: epochs\nmodel: {name: shakespeare-char, num_layers: 1}\ntrain: {max_epochs: 2, global_batch_size: 32}\n"
    )
    out = tmp_path / "o"
    code, _, err = gaudi3_cli("deploy", "render", "--target", target, "--accelerator", "h100", "--nodes", "2",
                              "--config", str(config), "--out", str(out))  # fmt: skip
    assert code == 0, err
    code, printed, err = gaudi3_cli("train", "--config", str(out / "docker" / "run.yaml"), "--print-config")
    assert code == 0, err
    assert yaml.safe_load(printed)["train"]["max_epochs"] == 2


def test_render_missing_config_is_one_line(gaudi3_cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    code, out, err = gaudi3_cli("deploy", "render", "--target", "k8s", "--accelerator", "gaudi3", "--nodes", "2",
                                "--config", str(missing), "--out", str(tmp_path / "o"))  # fmt: skip
    _one_line_error(code, out, err, "--config", str(missing))


def test_render_refuses_to_overwrite_a_changed_file_without_force(
    gaudi3_cli: Cli, config: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "o"
    args = ["deploy", "render", "--target", "k8s", "--accelerator", "gaudi3", "--nodes", "2", "--config",
            str(config), "--out", str(out_dir)]  # fmt: skip
    code, out, err = gaudi3_cli(*args)
    assert code == 0, err
    rendered = sorted(p for p in out_dir.rglob("*") if p.is_file() and RECORD_DIR not in p.parts)
    assert rendered
    edited = rendered[0]
    edited.write_text("# my edit\n")
    code, out, err = gaudi3_cli(*args)
    _one_line_error(code, out, err, str(edited), "--force")
    assert edited.read_text() == "# my edit\n"
    code, out, err = gaudi3_cli(*args, "--force")
    assert code == 0, err
    assert edited.read_text() != "# my edit\n"


# ---- resource names (issue 36 item 9) ---------------------------------------------------------------------------

LONG_NAME = "Llama3.2_1B-continued-pretraining.on-the-web-mix-2025"  # 53 characters, '.', '_' and capitals


def _render_named(cli: Cli, tmp_path: Path, target: str, config_text: str, out: str) -> tuple[str, Path]:
    """Render `config_text` for `target`; (stdout, the output directory). The render must succeed."""
    config = tmp_path / "named.yaml"
    config.write_text(config_text)
    out_dir = tmp_path / out
    code, stdout, err = cli("deploy", "render", "--target", target, *TARGET_FLAGS[target], "--config", str(config),
                            "--out", str(out_dir))  # fmt: skip
    assert code == 0, err
    return stdout, out_dir


def _printed_name(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("resource name: ")]
    assert len(lines) == 1, stdout  # printed once
    return lines[0].split()[2]


@pytest.mark.parametrize("preset", ["llama3.2-1b", "llama3.2-3b"])
@pytest.mark.parametrize("target", TARGET_FLAGS)
def test_the_llama_3_2_default_run_names_render_on_every_target(
    gaudi3_cli: Cli, tmp_path: Path, target: str, preset: str
) -> None:
    # No `name:`: the run is named after the preset, whose '.' no cloud resource name takes.
    text = f"model: {{name: {preset}}}\ntrain: {{max_steps: 10, global_batch_size: 16}}\n"
    stdout, out_dir = _render_named(gaudi3_cli, tmp_path, target, text, "out")
    derived = preset.replace(".", "-")
    assert _printed_name(stdout) == derived and f"'{preset}'" in stdout
    assert f"runs/{derived}-flow" in (out_dir / "metaflow" / "run.sh").read_text()  # every target ships it
    assert f"name: {preset}\n" in (out_dir / "docker" / "run.yaml").read_text()  # the run keeps its own name
    named = {
        "aws": ("terraform/variables.tf", f'default     = "{derived}"'),
        "azure": ("terraform/variables.tf", f'default     = "{derived}"'),
        "gcp": ("terraform/variables.tf", f'default     = "{derived}"'),
        "k8s": ("k8s/base/00-namespace.yaml", f"name: {derived}\n"),
    }
    if target in named:
        rel, needle = named[target]
        assert needle in (out_dir / rel).read_text(), rel


def test_a_long_run_name_is_cut_with_a_hash_the_same_way_every_time(
    gaudi3_cli: Cli, config: Path, tmp_path: Path
) -> None:
    text = f"name: {LONG_NAME}\nmodel: {{name: shakespeare-char, num_layers: 1}}\ntrain: {{global_batch_size: 32}}\n"
    names = {
        (target, out): _printed_name(_render_named(gaudi3_cli, tmp_path, target, text, f"{target}-{out}")[0])
        for target in ("gcp", "k8s", "aws")
        for out in ("a", "b")
    }
    (derived,) = set(names.values())  # stable: the same on every target and every render
    assert re.fullmatch(RUN_NAME, derived) and derived[0].isalpha() and len(derived) <= 40, derived
    assert re.fullmatch(r"llama3-2-1b-continued-pretrain[a-z-]*-[0-9a-f]{8}", derived), derived
    other = _render_named(gaudi3_cli, tmp_path, "k8s", text.replace("2025", "2026"), "other")[0]
    assert _printed_name(other) != derived  # names that differ only past the cut stay apart
    stdout, out_dir = _render_named(gaudi3_cli, tmp_path, "k8s", config.read_text(), "valid")
    assert "resource name" not in stdout  # a name every target takes is used as it is, and not printed
    assert "name: deploy-cli\n" in (out_dir / "k8s" / "base" / "00-namespace.yaml").read_text()


# ---- plan / apply / destroy ------------------------------------------------------------------------------------


def test_missing_tool_is_one_line(gaudi3_cli: Cli, terraform_dir: Path, manifests: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    code, out, err = gaudi3_cli("deploy", "plan", str(terraform_dir))
    _one_line_error(code, out, err, "terraform is not installed: ", str(terraform_dir), "PATH")
    code, out, err = gaudi3_cli("deploy", "apply", str(manifests), "--yes")
    _one_line_error(code, out, err, "kubectl is not installed: ", "apply")


def test_terraform_plan_runs_init_and_plan_in_the_directory(
    gaudi3_cli: Cli, tools, terraform_dir: Path
) -> None:
    # Given the render's root, the one subdirectory with *.tf files is the deployment.
    code, out, err = gaudi3_cli("deploy", "plan", str(terraform_dir.parent))
    assert code == 0, err
    where = str(terraform_dir)
    assert tools() == [
        (where, ["terraform", "init", "-input=false"]),
        (where, ["terraform", "plan", "-input=false"]),
    ]
    assert "$ terraform plan -input=false" in out


def test_apply_without_yes_prints_the_commands_and_runs_none(
    gaudi3_cli: Cli, tools, terraform_dir: Path
) -> None:
    code, out, err = gaudi3_cli("deploy", "apply", str(terraform_dir))
    _one_line_error(code, out, err, "--yes", "changes infrastructure")
    assert tools() == []
    assert "would run: terraform apply -input=false -auto-approve" in out
    code, out, err = gaudi3_cli("deploy", "destroy", str(terraform_dir))
    _one_line_error(code, out, err, "--yes")
    assert tools() == [] and "would run: terraform destroy -input=false -auto-approve" in out


def test_apply_and_destroy_with_yes(gaudi3_cli: Cli, tools, terraform_dir: Path) -> None:
    code, _, err = gaudi3_cli("deploy", "apply", str(terraform_dir), "--yes")
    assert code == 0, err
    code, _, err = gaudi3_cli("deploy", "destroy", str(terraform_dir), "--yes")
    assert code == 0, err
    assert [argv[1:] for _, argv in tools()] == [
        ["init", "-input=false"], ["plan", "-input=false"], ["apply", "-input=false", "-auto-approve"],
        ["init", "-input=false"], ["plan", "-destroy", "-input=false"], ["destroy", "-input=false", "-auto-approve"],
    ]  # fmt: skip


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("answer", "applied"), [("n\n", False), ("y\n", True)])
def test_a_terminal_is_asked_after_the_preview(
    gaudi3_cli: Cli, tools, terraform_dir: Path, monkeypatch: pytest.MonkeyPatch, answer: str, applied: bool
) -> None:
    monkeypatch.setattr(sys, "stdin", _Terminal(answer))
    code, out, err = gaudi3_cli("deploy", "apply", str(terraform_dir))
    subcommands = [argv[1] for _, argv in tools()]
    assert subcommands == ["init", "plan", *(["apply"] if applied else [])]
    assert code == (0 if applied else 1), err
    assert "terraform apply -input=false -auto-approve?" in out
    if not applied:
        assert "nothing was changed" in out


def test_a_failing_tool_stops_the_sequence(gaudi3_cli: Cli, tools, terraform_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_EXIT_PLAN", "3")
    code, _, err = gaudi3_cli("deploy", "apply", str(terraform_dir), "--yes")
    assert code == 1 and err == "gaudi3: error: `terraform plan -input=false` failed with exit code 3\n"
    assert [argv[1] for _, argv in tools()] == ["init", "plan"]  # never reached apply


def test_kubectl_plan_apply_destroy_pass_every_manifest(gaudi3_cli: Cli, tools, manifests: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_EXIT_DIFF", "1")  # kubectl diff: 1 means "there are differences", not an error
    files = ["-f", "base/00-namespace.yaml", "-f", "job.yaml"]  # run.yaml is no manifest
    code, _, err = gaudi3_cli("deploy", "plan", str(manifests))
    assert code == 0, err
    code, _, err = gaudi3_cli("deploy", "apply", str(manifests), "--yes")
    assert code == 0, err
    code, _, err = gaudi3_cli("deploy", "destroy", str(manifests), "--yes")
    assert code == 0, err
    calls = tools()
    assert {cwd for cwd, _ in calls} == {str(manifests)}
    assert [argv for _, argv in calls] == [
        ["kubectl", "apply", "--dry-run=server", *files], ["kubectl", "diff", *files],
        ["kubectl", "apply", "--dry-run=client", *files], ["kubectl", "apply", *files],
        ["kubectl", "delete", "--ignore-not-found", "--dry-run=server", *files],
        ["kubectl", "delete", "--ignore-not-found", *files],
    ]  # fmt: skip


def test_alternative_jobs_are_refused_and_files_can_be_picked(
    gaudi3_cli: Cli, tools, manifests: Path
) -> None:
    (manifests / "pytorchjob.yaml").write_text(
        "apiVersion: kubeflow.org/v1\nkind: PyTorchJob\nmetadata: {name: t, namespace: t}\n"
    )
    code, out, err = gaudi3_cli("deploy", "plan", str(manifests))
    _one_line_error(code, out, err, "job.yaml", "pytorchjob.yaml", "alternatives")
    assert tools() == []
    code, _, err = gaudi3_cli("deploy", "plan", str(manifests / "base"), str(manifests / "pytorchjob.yaml"))
    assert code == 0, err
    assert tools()[0] == (str(manifests),
                          ["kubectl", "apply", "--dry-run=server", "-f", "base/00-namespace.yaml", "-f", "pytorchjob.yaml"])  # fmt: skip


def test_a_kustomization_is_applied_with_k(gaudi3_cli: Cli, tools, manifests: Path) -> None:
    (manifests / "kustomization.yaml").write_text("resources: [base/00-namespace.yaml, job.yaml]\n")
    code, _, err = gaudi3_cli("deploy", "plan", str(manifests))
    assert code == 0, err
    assert [argv for _, argv in tools()] == [["kubectl", "apply", "--dry-run=server", "-k", "."],
                                             ["kubectl", "diff", "-k", "."]]  # fmt: skip


def test_nothing_to_deploy_and_several_deployments_are_one_line(
    gaudi3_cli: Cli, tools, terraform_dir: Path, manifests: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "nothing"
    empty.mkdir()
    (empty / "notes.yaml").write_text("a: 1\n")
    _one_line_error(*gaudi3_cli("deploy", "plan", str(empty)), "no Terraform", "Kubernetes manifests")
    both = terraform_dir.parent
    (both / "k8s.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
    _one_line_error(*gaudi3_cli("deploy", "plan", str(both)), "several deployments")
    _one_line_error(*gaudi3_cli("deploy", "plan", str(terraform_dir / "main.tf")), "directory")
    assert tools() == []


def test_plan_of_a_real_k8s_render_needs_a_job_flavour(
    gaudi3_cli: Cli, tools, config: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "render"
    code, _, err = gaudi3_cli("deploy", "render", "--target", "k8s", "--accelerator", "h100", "--nodes", "2",
                              "--config", str(config), "--out", str(out_dir))  # fmt: skip
    assert code == 0, err
    code, out, err = gaudi3_cli("deploy", "plan", str(out_dir))
    _one_line_error(code, out, err, "alternatives")
    k8s = out_dir / "k8s"
    code, _, err = gaudi3_cli("deploy", "plan", str(k8s / "base"), str(k8s / "pytorchjob.yaml"))
    assert code == 0, err
    first = tools()[0][1]
    passed = [first[i + 1] for i, a in enumerate(first) if a == "-f"]
    assert (
        passed[-1] == "pytorchjob.yaml"
        and all(p.startswith("base/") for p in passed[:-1])
        and len(passed) > 2
    )


# ---- collect ---------------------------------------------------------------------------------------------------


def _result(cell_id: str) -> dict[str, Any]:
    cell = cell_section(cell_id=cell_id, matrix=None, model="shakespeare-char", strategy="ddp", world_size=2,
                        nnodes=2, batch=BatchPlan.from_micro_batch(4, data_parallel_size=2, context_length=64),
                        precision="32-true", data="tinyshakespeare")  # fmt: skip
    records = [{"step": s, "train_loss": 4.0 - 0.1 * s, "step_time_s": 0.5, "tokens_per_s": 1024.0, "mfu": 0.01,
                "peak_memory_bytes_per_rank": [100, 101]} for s in range(1, 8)]  # fmt: skip
    env = {"cpu": "test cpu", "packages": {"torch": "2.13.0"}, "git_commit": None}
    return result_from_metrics(cell, records, warmup_steps=2, h2d_gbps=None, environment=env)


def _pod_log(path: Path, result: dict[str, Any]) -> Path:
    """A pod log as kubectl shows it: every line prefixed, another rank's lines in between."""
    printed = io.StringIO()
    print_result(result, printed)
    lines = [f"2026-11-23T18:00:0{i}Z {line}" for i, line in enumerate(printed.getvalue().splitlines())]
    lines.insert(1, "2026-11-23T18:00:00Z [rank 1] step 7 loss 3.3")
    path.write_text("starting\n" + "\n".join(lines) + "\n")
    return path


def test_collect_writes_results_from_log_files(gaudi3_cli: Cli, tmp_path: Path) -> None:
    result = _result("k8s.ddp.n2")
    log = _pod_log(tmp_path / "worker-0.log", result)
    code, out, err = gaudi3_cli("deploy", "collect", str(log), "--out", str(tmp_path / "res"))
    assert code == 0, err
    written = tmp_path / "res" / "cells" / "k8s.ddp.n2" / "result.json"
    assert json.loads(written.read_text()) == result and "1 result(s)" in out


def test_collect_reads_a_jobs_pods_with_kubectl(gaudi3_cli: Cli, tools, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    result = _result("k8s.fsdp.n2")
    pods = tmp_path / "pods.txt"
    pods.write_text("pod/train-worker-0\n")
    monkeypatch.setenv("FAKE_STDOUT_GET", str(pods))
    monkeypatch.setenv("FAKE_STDOUT_LOGS", str(_pod_log(tmp_path / "saved.log", result)))
    code, _, err = gaudi3_cli(
        "deploy", "collect", "--job", "train", "--namespace", "ml", "--out", str(tmp_path / "r")
    )
    assert code == 0, err
    assert json.loads((tmp_path / "r" / "cells" / "k8s.fsdp.n2" / "result.json").read_text()) == result
    calls = [argv for _, argv in tools()]
    assert calls[0][:4] == ["kubectl", "get", "pods", "-n"]
    assert calls[-1][1:3] == ["logs", "pod/train-worker-0"]


def test_collect_bad_input_is_one_line(gaudi3_cli: Cli, tmp_path: Path) -> None:
    _one_line_error(*gaudi3_cli("deploy", "collect", "--out", str(tmp_path)), "log files", "--job")
    _one_line_error(*gaudi3_cli("deploy", "collect", "x.log", "--namespace", "n", "--out", str(tmp_path)),
                    "--namespace")  # fmt: skip
    _one_line_error(
        *gaudi3_cli("deploy", "collect", str(tmp_path / "gone.log"), "--out", str(tmp_path)), "gone.log"
    )
    empty = tmp_path / "empty.log"
    empty.write_text("no markers here\n")
    _one_line_error(
        *gaudi3_cli("deploy", "collect", str(empty), "--out", str(tmp_path)), "no benchmark result"
    )
    assert not (tmp_path / "cells").exists()
