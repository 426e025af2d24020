"""The one node command (`deploy/node_command.py`): every target's nodes run `gaudi3 train` with the deployment's
geometry, and `gaudi3 deploy render` refuses, in one line, a run config those nodes would refuse at start.

Each test renders through the CLI and resolves the node's real argv (the k8s pod's args; the Terraform / Ansible
node script run with a stand-in `docker`) with the project's own config loader."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from deploy_readers import node_train_argv, resolve_node_argv
from gaudi3_scale.deploy.bootstrap import systemd_unit
from gaudi3_scale.deploy.render import RECORD_DIR
from render_targets import ONPREM_NODES, TARGET_FLAGS

Cli = Callable[..., tuple[int, str, str]]
BASE = "model: {name: shakespeare-char, num_layers: 1}\ntrain: {max_steps: 10, global_batch_size: 64}\n"
MIRROR = "checkpoint: {remote_url: 's3://bucket/run'}\n"  # lets nodes on their own disks resume (DDP)
NODE_TARGETS = ("aws", "azure", "gcp", "onprem", "k8s")
CLOUDS = ("aws", "azure", "gcp")


def _render(
    cli: Cli, tmp: Path, target: str, text: str, *extra: str, name: str = "o"
) -> tuple[int, str, Path]:
    config = tmp / f"{name}.yaml"
    config.write_text(text)
    out = tmp / name
    nodes = ONPREM_NODES if target == "onprem" else []  # the two-node geometry every target renders here
    code, _, err = cli("deploy", "render", "--target", target, *TARGET_FLAGS[target], *nodes, "--config", str(config),
                       "--out", str(out), *extra)  # fmt: skip
    return code, err, out


def _one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2 and err.startswith("gaudi3: error: ") and err.count("\n") == 1, (code, err)
    for needle in needles:
        assert needle in err, err


# ---- findings 6, 7: every node trains the deployment's geometry into the mounted workspace ------------------------

ENDPOINTS = {"aws": "10.0.0.5:29500", "azure": "10.0.0.5:29500", "gcp": "10.0.0.5:29500", "onprem": "a:29500",
             "k8s": "stale-master-0:29400"}  # fmt: skip


@pytest.mark.parametrize("target", NODE_TARGETS)
def test_every_node_trains_the_deployments_geometry_into_the_workspace(
    gaudi3_cli: Cli, tmp_path: Path, target: str
) -> None:
    """A config written for another cluster (8 nodes, node0's rendezvous, out_dir on an NFS path the nodes do not
    mount): each node still trains 2 × 8 ranks, meets at its own deployment's node 0 and writes under /workspace."""
    text = ("name: stale\n" + BASE + MIRROR + "out_dir: /mnt/shared/runs/stale\n"
            "parallel: {nnodes: 8, node_rank: 3, rdzv_endpoint: 'node0:29500'}\n")  # fmt: skip
    code, err, out = _render(gaudi3_cli, tmp_path, target, text)
    assert code == 0, err
    cfg = resolve_node_argv(out, node_train_argv(out, target, tmp_path))
    assert (cfg.parallel.nnodes, cfg.parallel.nproc_per_node, cfg.parallel.node_rank) == (2, 8, 1)
    assert cfg.parallel.rdzv_endpoint == ENDPOINTS[target]
    assert str(cfg.out_dir) == "/workspace/runs/stale"  # the volume every target mounts there


def test_a_single_node_job_does_not_wait_for_the_files_rendezvous(gaudi3_cli: Cli, tmp_path: Path) -> None:
    text = "name: stale\n" + BASE + "parallel: {nnodes: 2, rdzv_endpoint: 'node0:29500'}\n"
    code, err, out = _render(gaudi3_cli, tmp_path, "k8s", text, "--nodes", "1", "--per-node", "2")
    assert code == 0, err
    cfg = resolve_node_argv(out, node_train_argv(out, "k8s", tmp_path, nodes=1))
    assert (cfg.parallel.nnodes, cfg.parallel.nproc_per_node, cfg.parallel.node_rank) == (1, 2, 0)
    # its own loopback (NodeSlots' None), neither node0 nor a DNS name the pod would wait on for its own record
    assert cfg.parallel.rdzv_endpoint is None
    for manifest in ("pytorchjob.yaml", "indexed-job.yaml"):
        text = (out / "k8s" / manifest).read_text()
        assert "--parallel.rdzv_endpoint=null" in text and ":29400" not in text.split("args:", 1)[1], manifest
    # the shipped run config is one node of the deployment (what the Metaflow flow trains), with no endpoint
    parallel = yaml.safe_load((out / "docker" / "run.yaml").read_text())["parallel"]
    assert (parallel["nnodes"], parallel["nproc_per_node"], parallel["rdzv_endpoint"]) == (1, 2, None)


# ---- finding 3: checkpoints off, no bucket URL ----------------------------------------------------------------


@pytest.mark.parametrize("target", CLOUDS)
def test_cloud_nodes_get_the_bucket_only_when_checkpoints_are_written(
    gaudi3_cli: Cli, tmp_path: Path, target: str
) -> None:
    off = "name: bench\n" + BASE + "checkpoint: {enabled: false}\n"
    code, err, out = _render(gaudi3_cli, tmp_path, target, off, name="off")
    assert code == 0, err
    argv = node_train_argv(out, target, tmp_path)
    assert not any(a.startswith("--checkpoint.remote_url") for a in argv)
    assert resolve_node_argv(out, argv).checkpoint.enabled is False  # the node starts
    code, err, out = _render(gaudi3_cli, tmp_path, target, "name: bench\n" + BASE, name="on")
    assert code == 0, err
    cfg = resolve_node_argv(out, node_train_argv(out, target, tmp_path))
    assert cfg.checkpoint.remote_url.endswith("://ckpt/run")  # the bucket Terraform made (deploy_readers)


# ---- finding 5: the deploy geometry applies before the file is judged ------------------------------------------

PARALLEL = {
    "tp": ("parallel: {strategy: fsdp, tp_size: 8}\n", "tp_size", 8),
    "pp": ("parallel: {strategy: fsdp, pp_size: 4}\n", "pp_size", 4),
    "hsdp": ("parallel: {strategy: fsdp, dp_replicate: 2}\n", "dp_replicate", 2),
}


@pytest.mark.parametrize("case", PARALLEL)
def test_tp_pp_hsdp_configs_render_without_their_own_nproc_per_node(
    gaudi3_cli: Cli, tmp_path: Path, case: str
) -> None:
    section, field, size = PARALLEL[case]
    text = (f"name: {case}\nmodel: {{name: llama3-8b}}\n{section}"
            "train: {max_steps: 10, global_batch_size: 256, micro_batch_size: 2, precision: bf16-mixed}\n")  # fmt: skip
    code, err, out = _render(gaudi3_cli, tmp_path, "k8s", text, "--per-node", "8")
    assert code == 0, err
    cfg = resolve_node_argv(out, node_train_argv(out, "k8s", tmp_path))
    assert getattr(cfg.parallel, field) == size and cfg.parallel.world_size == 16
    # still refused where the deployment really cannot hold it, naming the deployment's numbers
    code, err, _ = _render(gaudi3_cli, tmp_path, "k8s", text, "--per-node", "2", name="small")
    if case == "tp":
        _one_line(code, err, "2 node(s) × 2 per node", "tp_size", "(2)")
        assert "(1)" not in err


# ---- finding 12: one metrics-port check for every target ------------------------------------------------------


@pytest.mark.parametrize("target", NODE_TARGETS)
def test_metrics_ports_over_the_rendezvous_port_are_refused_on_every_target(
    gaudi3_cli: Cli, tmp_path: Path, target: str
) -> None:
    rdzv = 29400 if target == "k8s" else 29500
    text = "name: mp\n" + BASE + MIRROR + f"monitor: {{metrics_port: {rdzv - 4}}}\n"
    code, err, _ = _render(gaudi3_cli, tmp_path, target, text)
    _one_line(code, err, f"{rdzv} is one of the metrics ports {rdzv - 4}-{rdzv + 3}")
    code, err, _ = _render(gaudi3_cli, tmp_path, target, text.replace(str(rdzv - 4), "9100"), name="ok")
    assert code == 0, err


# ---- finding 4: nodes on their own disks ------------------------------------------------------------------------

OWN_DISKS = {"onprem": [], "k8s": ["--set", "storage=emptydir"]}


@pytest.mark.parametrize("target", OWN_DISKS)
def test_nodes_on_their_own_disks_refuse_per_rank_checkpoints(
    gaudi3_cli: Cli, tmp_path: Path, target: str
) -> None:
    fsdp = "name: own\n" + BASE + MIRROR + "parallel: {strategy: fsdp}\n"
    code, err, out = _render(gaudi3_cli, tmp_path, target, fsdp, *OWN_DISKS[target])
    _one_line(code, err, f"--target {target}: each node keeps the run's --out on its own disk",
              "with parallel.strategy fsdp every rank writes its part")  # fmt: skip
    assert not out.exists()
    code, err, _ = _render(
        gaudi3_cli, tmp_path, target, fsdp.replace("fsdp", "ddp"), *OWN_DISKS[target], name="d"
    )
    assert code == 0, err  # rank 0 writes the checkpoint alone and mirrors it: the other nodes resume from it
    if target == "k8s":  # a volume every pod mounts
        code, err, _ = _render(gaudi3_cli, tmp_path, target, fsdp, name="pvc")
        assert code == 0, err


def test_the_render_refuses_exactly_what_the_nodes_check_would(gaudi3_cli: Cli, tmp_path: Path) -> None:
    """The render's rule (`node_command._check_shared_out`) against the one every rank applies at start
    (`train.nodes.nodes_problem`), for a node that does not see rank 0's --out."""
    from gaudi3_scale.train.config import per_rank_checkpoints, resolve_config
    from gaudi3_scale.train.nodes import RankView, nodes_problem

    views = [RankView(0, "a", True, None), RankView(8, "b", False, None)]
    for strategy in ("ddp", "fsdp", "deepspeed_zero2"):
        for checkpoint in ("{}", "{remote_url: 's3://b/r'}", "{enabled: false}"):
            text = f"name: rule\n{BASE}parallel: {{strategy: {strategy}}}\ncheckpoint: {checkpoint}\n"
            code, err, _ = _render(gaudi3_cli, tmp_path, "onprem", text, "--accelerator", "h100",
                                     name=f"{strategy}-{len(checkpoint)}")  # fmt: skip
            config = tmp_path / f"{strategy}-{len(checkpoint)}.yaml"
            cfg = resolve_config(str(config), ["--parallel.nnodes=2", "--parallel.rdzv_endpoint=a:29500",
                                               "--parallel.nproc_per_node=8"])  # fmt: skip
            problem = nodes_problem(views, out_dir=Path("/workspace/runs/rule"),
                                    per_rank_files=per_rank_checkpoints(cfg.parallel),
                                    remote_url=cfg.checkpoint.remote_url, checkpoints=cfg.checkpoint.enabled)  # fmt: skip
            assert (code == 2) == (problem is not None), (strategy, checkpoint, code, err, problem)


# ---- finding 16: the CI repro tier on a hosted runner ----------------------------------------------------------


def test_a_hosted_repro_of_a_cuda_config_trains_on_the_cpu(gaudi3_cli: Cli, tmp_path: Path) -> None:
    from gaudi3_scale.cli.repro_cmd import repro
    from gaudi3_scale.train.config import resolve_config

    text = "name: cuda\n" + BASE.replace("max_steps: 10,", "max_steps: 10, device: cuda,")
    code, err, out = _render(gaudi3_cli, tmp_path, "ci", text)
    assert code == 0, err
    jobs = yaml.safe_load((out / ".github" / "workflows" / "gaudi3.yml").read_text())["jobs"]
    assert jobs["repro"]["runs-on"] == "ubuntu-latest"  # hosted: no GPU
    (run,) = [s["run"] for s in jobs["repro"]["steps"] if s.get("run", "").startswith("gaudi3 repro")]
    ctx = repro.make_context("repro", shlex.split(run)[2:])
    cfg = resolve_config(str(out / ctx.params["config_path"]), list(ctx.params["overrides"]))
    assert cfg.train.device == "cpu" and cfg.parallel.nnodes == 1 and cfg.parallel.rdzv_endpoint is None


# ---- finding 18: --force re-renders prune what the new render does not produce ---------------------------------


def _tree(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()}


def test_a_forced_re_render_removes_the_files_it_no_longer_produces(gaudi3_cli: Cli, tmp_path: Path) -> None:
    text = "name: st\n" + BASE + MIRROR + "monitor: {metrics_port: 9100}\n"
    code, err, out = _render(gaudi3_cli, tmp_path, "k8s", text)
    assert code == 0, err
    assert (out / "k8s/base/03-storage.yaml").is_file() and (out / "k8s/monitoring").is_dir()
    (out / "k8s/base/mine.yaml").write_text("# not rendered\n")  # a file of the user's
    aws = ["--target", "aws", "--accelerator", "h100", "--nodes", "2", "--config", str(tmp_path / "o.yaml")]
    assert gaudi3_cli("deploy", "render", *aws, "--out", str(out))[0] == 0  # another target, same --out
    other = ["--set", "storage=emptydir", "--set", "monitoring=false"]
    code, err, _ = _render(gaudi3_cli, tmp_path, "k8s", text, *other)
    _one_line(code, err, "was rendered before and would not be now", "--force")
    assert (out / "k8s/base/03-storage.yaml").is_file()  # nothing removed without --force
    code, err, _ = _render(gaudi3_cli, tmp_path, "k8s", text, *other, "--force")
    assert code == 0, err
    code, err, fresh = _render(gaudi3_cli, tmp_path, "k8s", text, *other, name="fresh")
    assert code == 0, err
    again = _tree(out)
    assert again.pop("k8s/base/mine.yaml") == "# not rendered\n"  # never removed: no render wrote it
    assert {k: v for k, v in again.items() if k.startswith("k8s/")} == {
        k: v.replace("fresh.yaml", "o.yaml") for k, v in _tree(fresh).items() if k.startswith("k8s/")
    }  # the same files as a fresh render (whose comments name its own config file)
    assert not (out / "k8s/monitoring").exists()  # its directory went with its files
    assert (out / "terraform" / "main.tf").is_file() and (out / "docker" / "run.yaml").is_file()  # aws's stay
    assert sorted(p.name for p in (out / RECORD_DIR).iterdir()) == ["aws.files", "k8s.files"]


def test_a_tampered_render_list_removes_nothing_outside_the_output(gaudi3_cli: Cli, tmp_path: Path) -> None:
    text = "name: st\n" + BASE
    code, err, out = _render(gaudi3_cli, tmp_path, "k8s", text)
    assert code == 0, err
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (out / RECORD_DIR / "k8s.files").write_text(f"../victim.txt\n{victim}\n")
    code, err, _ = _render(gaudi3_cli, tmp_path, "k8s", text, "--force")
    assert code == 0, err
    assert victim.read_text() == "keep"


# ---- finding 20: Terraform's count variables, the unit's comment ------------------------------------------------


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform is not installed")
def test_terraform_refuses_node_and_rank_counts_every_node_would_refuse(
    gaudi3_cli: Cli, tmp_path: Path
) -> None:
    code, err, out = _render(gaudi3_cli, tmp_path, "aws", "name: tf\n" + BASE)
    assert code == 0, err
    blocks = re.split(r"\n(?=variable \")", (out / "terraform" / "variables.tf").read_text())
    module = tmp_path / "tf"
    module.mkdir()
    (module / "variables.tf").write_text(
        "\n".join(b for b in blocks if b.startswith(('variable "nodes"', 'variable "nproc_per_node"')))
    )
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(tmp_path), "TF_IN_AUTOMATION": "1"}
    terraform = shutil.which("terraform")
    assert terraform
    subprocess.run([terraform, "init", "-backend=false", "-input=false"], cwd=module, env=env, check=True,
                   capture_output=True)  # fmt: skip
    for var, ok in (("nproc_per_node=0", False), ("nproc_per_node=1.5", False), ("nodes=0", False),
                    ("nproc_per_node=4", True), ("nodes=3", True)):  # fmt: skip
        done = subprocess.run([terraform, "plan", "-input=false", "-no-color", "-var", var], cwd=module, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert (done.returncode == 0) == ok, (var, done.stdout[-2000:], done.stderr[-2000:])
        if not ok:
            assert "must be a whole number of at least 1" in done.stderr


def test_the_units_comment_names_every_exit_code_it_does_not_restart() -> None:
    unit = systemd_unit(fetch_secrets=False)
    (codes,) = re.findall(r"^RestartPreventExitStatus=(.*)$", unit, re.M)
    commented = re.findall(r"^#   (\d+): ", unit, re.M)
    assert commented == codes.split() and len(commented) >= 4
