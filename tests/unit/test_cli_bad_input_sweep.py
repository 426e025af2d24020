"""The bad-input sweep of every `gaudi3` verb: each row is a mistake an experienced user plausibly types, answered
with exit code 2 and exactly one `gaudi3: error:` line on stderr that names what is wrong and what is allowed, and
no traceback. Rows that name files (`keep`) also check that what was already on disk is byte-identical afterwards.

The first block holds the cases the sweep found broken (tracebacks, stray lines, flags silently ignored); the second
a representative set that already worked, so a regression shows. Everything runs in this process (`main`) and, but
for one tiny real training run that provides a checkpoint, in modes that refuse before any work is done.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from gaudi3_scale.cli.main import main

Args = Callable[[dict[str, Path]], list[str]]


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released): a connection there is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny trained run (one committed checkpoint), damaged copies of that checkpoint, and plain files."""
    root = tmp_path_factory.mktemp("sweep")
    run, text = root / "run", root / "notes.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 100)  # tokenized in milliseconds
    main(["train", "--out", str(run), "--data.source", str(text), "--model.num_layers", "1", "--model.dim", "32",
          "--model.context_length", "32", "--train.global_batch_size", "2", "--train.max_steps", "1",
          "--train.val_every_steps", "0", "--train.threads", "1", "--sample-tokens", "0", "--no-progress"])  # fmt: skip
    step = run / "checkpoints" / "step-00000001"
    p = {"root": root, "run": run, "step": step, "a_file": text, "empty": root / "empty"}
    p["empty"].mkdir()
    p["trunc"] = root / "trunc"
    shutil.copytree(step, p["trunc"])
    data = (step / "state.ckpt").read_bytes()
    (p["trunc"] / "state.ckpt").write_bytes(data[: len(data) // 2])
    p["bad_manifest"] = root / "bad_manifest"
    shutil.copytree(step, p["bad_manifest"])
    (p["bad_manifest"] / "manifest.json").write_text('{"format": "gaudi3-chec')
    p["export"] = root / "export"  # a non-empty --out
    p["export"].mkdir()
    (p["export"] / "keep.txt").write_text("mine\n")
    p["no_tok"] = root / "no_tokenizer"
    p["no_tok"].mkdir()
    p["list.yaml"] = root / "list.yaml"
    p["list.yaml"].write_text("- a\n- b\n")
    p["syntax.yaml"] = root / "syntax.yaml"
    p["syntax.yaml"].write_text("name: x\nmodel: {num_layers: 1\n")
    p["good.yaml"] = root / "good.yaml"
    p["good.yaml"].write_text(
        "name: x\nmodel: {num_layers: 1}\ntrain: {max_steps: 2, global_batch_size: 16}\n"
    )
    p["rendered"] = root / "rendered"
    main(["deploy", "render", "--target", "k8s", "--accelerator", "h100", "--nodes", "1", "--config",
          str(p["good.yaml"]), "--out", str(p["rendered"])])  # fmt: skip
    for name, report in [("hang_list", "[1]"), ("hang_time", '{"silent": [], "detected_by_rank": 0, '
                         '"detected_by_step": 1, "detected_unix_s": 1e30, "exit_code": 143}')]:  # fmt: skip
        (root / name / "health").mkdir(parents=True)
        (root / name / "health" / "hang-rank0.json").write_text(report)
        p[name] = root / name
    p["project"] = root / "project"  # a directory of the user's own: a run there would overwrite config.yaml
    p["project"].mkdir()
    (p["project"] / "config.yaml").write_text("# my notes\nfoo: 1\n")
    # the same, with another tool's weights in a checkpoints/ folder (not a run: no step-*/, latest or .run.lock)
    p["project_ckpts"] = root / "project-ckpts"
    (p["project_ckpts"] / "checkpoints").mkdir(parents=True)
    (p["project_ckpts"] / "checkpoints" / "model.pt").write_text("weights\n")
    (p["project_ckpts"] / "summary.json").write_text('{"mine": 1}\n')
    p["checkpoints_file"] = root / "checkpoints-file"  # a run directory whose checkpoints/ is a file
    p["checkpoints_file"].mkdir()
    (p["checkpoints_file"] / "checkpoints").write_text("not a directory\n")
    p["blocked"] = root / "blocked"  # a render target whose k8s/ is a file: refused before docker/ is written
    p["blocked"].mkdir()
    (p["blocked"] / "k8s").write_text("mine\n")
    p["hf_model"] = (
        root / "hf-model"
    )  # not a prepared dataset: preparing into it would replace its tokenizer.json
    p["hf_model"].mkdir()
    (p["hf_model"] / "tokenizer.json").write_text('{"mine": true}')
    p["remote"] = root / "remote"  # another run's mirror, holding its checkpoint
    shutil.copytree(step, p["remote"] / step.name)
    # tune outputs whose trials.jsonl is damaged: refused before base.yaml is rewritten
    for name, line in [("tune_null", b"null"), ("tune_list", b"[1, 2]"), ("tune_bytes", b'\xff\xfe{"x": 1}')]:
        p[name] = root / name
        p[name].mkdir()
        (p[name] / "trials.jsonl").write_bytes(
            b'{"fingerprint": "another search", "result": {}}\n' + line + b"\n"
        )
        (p[name] / "base.yaml").write_text("# mine\n")
    p["edited"] = p["rendered"] / "k8s" / "base" / "02-config.yaml"
    p["edited"].write_text(p["edited"].read_text() + "# edited by hand\n")
    return p


def _train(p: dict[str, Path], *extra: str) -> list[str]:
    return ["train", "--out", str(p["root"] / "new-run"), "--model.num_layers", "1", "--sample-tokens", "0",
            "--no-progress", *extra]  # fmt: skip


def _prepare(p: dict[str, Path], *extra: str) -> list[str]:
    return ["prepare", str(p["a_file"]), *extra]


_TUNE = ["tune", "--model.num_layers", "1"]
_TUNE_ONE = ["--strategies", "auto", "--precisions", "32-true", "--activation-checkpointing", "off", "--compile", "off",
             "--pipeline", "off"]  # fmt: skip
_RENDER = ["deploy", "render", "--target", "k8s", "--accelerator", "h100", "--nodes", "1"]
_COMPARE = ["cost", "compare", "--model", "70B", "--tokens", "1T", "--platforms", "h100"]
_QUOTE = ["cost", "quote", "--provider", "azure", "--type", "Standard_ND96isr_H100_v5", "--region", "eastus"]

# (id, command, words the line must hold, fixture paths whose files must be unchanged afterwards)
Case = tuple[str, Args, tuple[str, ...], tuple[str, ...]]
# a 2-stage pipeline, checked by the config only
_PP2 = ["train", "--print-config", "--model.name", "llama-tiny", "--parallel.nproc_per_node", "2", "--parallel.pp_size", "2"]  # fmt: skip
FIXED: list[Case] = [
    ("train-out-is-a-file", lambda p: _train(p, "--out", str(p["a_file"])), ("out_dir:", "is a file", "pass a directory"), ("a_file",)),
    ("train-out-inside-a-file", lambda p: _train(p, "--out", str(p["a_file"] / "sub")), ("out_dir:", "which is a file"), ("a_file",)),
    ("train-remote-ftp-refused", lambda p: _train(p, "--checkpoint.remote_url", f"ftp://127.0.0.1:{_closed_port()}/ck"), ("checkpoint.remote_url:", "cannot reach", "ConnectionRefusedError"), ()),
    ("train-remote-s3-no-bucket", lambda p: _train(p, "--checkpoint.remote_url", "s3://"), ("checkpoint.remote_url:", "names no bucket", "s3://bucket/prefix"), ()),
    ("prepare-out-is-a-file", lambda p: _prepare(p, "--out", str(p["a_file"])), ("--out:", "is a file"), ("a_file",)),
    ("prepare-out-ftp-refused", lambda p: _prepare(p, "--out", f"ftp://127.0.0.1:{_closed_port()}/data"), ("--out:", "cannot reach"), ()),
    ("prepare-out-s3-no-bucket", lambda p: _prepare(p, "--out", "s3://"), ("--out:", "names no bucket"), ()),
    ("prepare-unknown-tokenizer", lambda p: _prepare(p, "--out", str(p["root"] / "d1"), "--tokenizer", "wordpiece"), ("--tokenizer: unknown tokenizer 'wordpiece'", "allowed: bpe, byte, char"), ()),
    ("prepare-char-with-vocab-size", lambda p: _prepare(p, "--out", str(p["root"] / "d2"), "--vocab-size", "100"), ("--vocab-size: tokenizer=char takes its vocabulary from the data", "tokenizer=bpe"), ()),
    ("prepare-val-fraction-too-big", lambda p: _prepare(p, "--out", str(p["root"] / "d4"), "--val-fraction", "0.9"), ("--val-fraction: must be between 0.0 and 0.5, got 0.9",), ()),
    ("prepare-bpe-without-vocab-size", lambda p: _prepare(p, "--out", str(p["root"] / "d3"), "--tokenizer", "bpe"), ("tokenizer=bpe needs vocab_size from 256",), ()),
    ("tune-accelerator-without-estimate-only", lambda p: [*_TUNE, "--accelerator", "h100"], ("--accelerator: only with --estimate-only",), ()),
    ("tune-estimate-only-with-strategies", lambda p: [*_TUNE, "--estimate-only", "--strategies", "ddp,foo"], ("--strategies: only shapes the search", "--train.precision"), ()),
    ("tune-estimate-only-with-precisions", lambda p: [*_TUNE, "--estimate-only", "--precisions", "fp64"], ("--precisions: only shapes the search",), ()),
    ("tune-target-utilization-bound-once", lambda p: [*_TUNE, "--estimate-only", "--target-utilization", "2"], ("must be a fraction from 0.05 to 1, got 2",), ()),
    ("serve-port-bound-once", lambda p: ["serve", str(p["step"]), "--port", "70000"], ("--port: expected a TCP port 0..65535 (0: any free port), got 70000",), ()),
    ("ckpt-list-no-checkpoints", lambda p: ["ckpt", "list", str(p["empty"])], ("holds no checkpoints", "pass a run directory or its checkpoints/"), ()),
    ("ckpt-list-one-checkpoint", lambda p: ["ckpt", "list", str(p["step"])], ("is one checkpoint, not a run", "gaudi3 ckpt verify"), ("step",)),
    ("ckpt-export-tokenizer-dir-without-tokenizer", lambda p: ["ckpt", "export", str(p["step"]), "--out", str(p["root"] / "x1"), "--tokenizer", str(p["no_tok"])], ("--tokenizer", "no tokenizer.json there"), ("step",)),
    ("generate-tokenizer-dir-without-tokenizer", lambda p: ["generate", str(p["step"]), "--tokenizer", str(p["no_tok"])], ("--tokenizer", "no tokenizer.json there"), ()),
    ("cost-quote-endpoint-ftp", lambda p: [*_QUOTE, "--endpoint-url", "ftp://prices.example/x"], ("--endpoint-url:", "http:// or https://"), ()),
    ("cost-quote-endpoint-port", lambda p: [*_QUOTE, "--endpoint-url", "http://127.0.0.1:99999/x"], ("--endpoint-url:", "Port out of range"), ()),
    ("train-spot-endpoint-ftp", lambda p: ["train", "--print-config", "--cost.spot_endpoint_url", "ftp://x"], ("cost.spot_endpoint_url:", "http:// or https://"), ()),
    # the second sweep (2026-11-30): outputs below a file, sizes no estimate can hold, what checkpoints alone use
    ("train-out-a-directory-of-ones-own", lambda p: _train(p, "--out", str(p["project"])), ("out_dir:", "holds config.yaml but no gaudi3 run"), ("project",)),
    ("train-out-a-project-with-a-checkpoints-folder", lambda p: _train(p, "--out", str(p["project_ckpts"])), ("out_dir:", "holds summary.json but no gaudi3 run"), ("project_ckpts",)),
    ("train-checkpoints-is-a-file", lambda p: _train(p, "--out", str(p["checkpoints_file"])), ("out_dir:", "checkpoints' is a file"), ("checkpoints_file",)),
    ("plan-over-a-trained-runs-forecast", lambda p: ["plan", "--model.num_layers", "1", "--out_dir", str(p["run"])], ("out_dir:", "holds a run that has trained", "--out FILE"), ("run",)),
    ("plan-out-inside-a-file", lambda p: ["plan", "--model.num_layers", "1", "--out", str(p["a_file"] / "plan.json")], ("--out:", "is a file"), ("a_file",)),
    ("plan-out-dir-is-a-file", lambda p: ["plan", "--model.num_layers", "1", "--out_dir", str(p["a_file"])], ("out_dir:", "is a file"), ("a_file",)),
    ("cost-compare-out-inside-a-file", lambda p: [*_COMPARE, "--out", str(p["a_file"] / "sub")], ("--out:", "which is a file"), ("a_file",)),
    ("tune-out-inside-a-file", lambda p: [*_TUNE, "--out", str(p["a_file"] / "sub"), "--strategies", "auto", "--precisions", "32-true", "--activation-checkpointing", "off", "--compile", "off", "--pipeline", "off"], ("--out:", "which is a file"), ("a_file",)),
    ("smoke-out-inside-a-file", lambda p: ["smoke", "--out", str(p["a_file"] / "sub")], ("--out:", "which is a file"), ("a_file",)),
    ("repro-out-inside-a-file", lambda p: ["repro", "--out", str(p["a_file"] / "sub"), "--steps", "2"], ("--out:", "which is a file"), ("a_file",)),
    ("tune-trials-jsonl-null", lambda p: [*_TUNE, *_TUNE_ONE, "--out", str(p["tune_null"])], ("trials.jsonl:2: not a trial record", "got 'null'", "delete the line or use a new --out"), ("tune_null",)),
    # the base config's precision is not a trial's (`--precisions` is): 16-mixed there is no refusal on a CPU
    ("tune-base-precision-not-a-trials", lambda p: [*_TUNE, *_TUNE_ONE, "--train.precision", "16-mixed", "--out", str(p["tune_null"])], ("trials.jsonl:2: not a trial record",), ("tune_null",)),
    ("tune-trials-jsonl-list", lambda p: [*_TUNE, *_TUNE_ONE, "--out", str(p["tune_list"])], ("trials.jsonl:2: not a trial record", "got '[1, 2]'"), ("tune_list",)),
    ("tune-trials-jsonl-not-utf8", lambda p: [*_TUNE, *_TUNE_ONE, "--out", str(p["tune_bytes"])], ("trials.jsonl:2: not a trial record (byte 0xff at column 1 is not UTF-8)",), ("tune_bytes",)),
    # a 1 MiB budget: without the bound, the space builds and the budget is what is refused
    ("tune-global-batch-huge", lambda p: [*_TUNE, *_TUNE_ONE, "--global-batch", "2000000000", "--memory-budget", "1MiB", "--out", str(p["root"] / "t2")], ("--global-batch: the tuner searches global batches of 1 to 1,048,576 sequences, got 2,000,000,000",), ()),
    ("tune-memory-budget-holds-nothing", lambda p: [*_TUNE, *_TUNE_ONE, "--memory-budget", "1MiB", "--out", str(p["root"] / "t4")], ("--memory-budget 0.00 GiB per rank cannot hold any configuration",), ()),
    ("tune-config-global-batch-huge", lambda p: [*_TUNE, *_TUNE_ONE, "--train.global_batch_size", "1048577", "--memory-budget", "1MiB", "--out", str(p["root"] / "t3")], ("train.global_batch_size: the tuner searches global batches of 1 to 1,048,576",), ()),
    ("plan-nodes-huge", lambda p: ["plan", "--machine", "h100", "--nodes", "2147483647"], ("--nodes: must be a positive integer up to 1,048,576",), ()),
    ("cost-compare-nodes-huge", lambda p: [*_COMPARE, "--nodes", "2147483647"], ("--nodes: must be a positive integer up to 1,048,576",), ()),
    ("tune-world-size-huge", lambda p: [*_TUNE, "--estimate-only", "--accelerator", "h100", "--world-size", "2147483640"], ("--world-size: must be a positive integer up to 1,048,576",), ()),
    ("train-nnodes-huge", lambda p: ["train", "--print-config", "--parallel.nnodes", "2147483647"], ("parallel.nnodes: must be <= 1048576",), ()),
    ("train-ranks-huge", lambda p: ["train", "--print-config", "--parallel.nproc_per_node", "2097152"], ("parallel.nproc_per_node:", "more than 1,048,576 ranks"), ()),
    ("serve-max-queue-huge", lambda p: ["serve", str(p["step"]), "--max-queue", "2147483647"], ("--max-queue: must be a positive integer up to 65,536",), ()),
    ("ckpt-export-out-cwd", lambda p: ["ckpt", "export", str(p["step"]), "--out", "."], ("is the current directory or holds it",), ("step",)),
    ("ckpt-export-force-into-a-checkpoint", lambda p: ["ckpt", "export", str(p["step"]), "--out", str(p["trunc"]), "--force"], ("holds the committed checkpoint",), ("trunc",)),
    ("cost-quote-timeout-huge", lambda p: [*_QUOTE, "--timeout-s", "1e300"], ("--timeout-s: must be a positive number of seconds up to 1e+09",), ()),
    ("cost-quote-empty-type", lambda p: ["cost", "quote", "--provider", "aws", "--type", " ", "--region", "us-east-1"], ("--type: empty",), ()),
    ("cost-compare-pue-below-1", lambda p: [*_COMPARE, "--pue", "0.5"], ("--pue: must be a finite number >= 1",), ()),
    ("cost-compare-power-fraction-huge", lambda p: [*_COMPARE, "--power-fraction", "1e300"], ("--power-fraction:",), ()),
    ("train-price-huge", lambda p: ["train", "--print-config", "--cost.price_usd_per_hour", "1e300"], ("cost.price_usd_per_hour: must be <= 1e+12",), ()),
    ("train-light-without-checkpoints", lambda p: ["train", "--print-config", "--checkpoint.enabled", "false", "--checkpoint.light_every_steps", "3"], ("checkpoint.light_every_steps: 3 would be ignored", "checkpoint.enabled is false"), ()),
    ("train-remote-without-checkpoints", lambda p: ["train", "--print-config", "--checkpoint.enabled", "false", "--checkpoint.remote_url", "file:///x"], ("checkpoint.remote_url:", "would be ignored"), ()),
    ("train-resume-never-over-a-remote", lambda p: _train(p, "--resume", "never", "--checkpoint.remote_url", f"file://{p['remote']}"), ("already holds checkpoints", "train.resume is 'never'"), ("remote",)),
    ("tune-estimate-only-with-global-batch", lambda p: [*_TUNE, "--estimate-only", "--global-batch", "48"], ("--global-batch: only shapes the search", "--train.global_batch_size"), ()),
    ("tune-estimate-only-with-target-utilization", lambda p: [*_TUNE, "--estimate-only", "--accelerator", "h100", "--target-utilization", "0.05"], ("--target-utilization: only shapes the search", "--memory-budget"), ()),
    ("tune-estimate-only-with-out", lambda p: [*_TUNE, "--estimate-only", "--out", str(p["root"] / "t1")], ("--out: only shapes the search",), ()),
    ("plan-compare-with-out", lambda p: ["plan", "--compare", str(p["run"]), "--out", str(p["root"] / "c.json")], ("--out: not with --compare",), ()),
    ("plan-compare-without-summary", lambda p: ["plan", "--compare", str(p["empty"])], ("has no summary.json",), ()),
    ("plan-machine-with-refresh-peak", lambda p: ["plan", "--machine", "h100", "--refresh-peak"], ("--refresh-peak: measures this machine's peak",), ()),
    ("train-light-with-a-pipeline", lambda p: ["train", "--print-config", "--parallel.pp_size", "2", "--parallel.nproc_per_node", "2", "--model.num_layers", "2", "--model.tie_embeddings", "false", "--checkpoint.light_every_steps", "1", "--checkpoint.every_steps", "3"], ("checkpoint.light_every_steps:", "parallel.pp_size 2 (FSDP2) saves sharded checkpoints"), ()),
    ("train-epochs-with-warmup-past-them", lambda p: _train(p, "--train.max_epochs", "1", "--train.throughput_warmup_steps", "100000"), ("train.throughput_warmup_steps: 100000 leaves no measured step", "train.max_epochs 1 gives"), ()),
    ("cost-catalog-bad-file", lambda p: ["cost", "catalog", "--catalog", str(p["list.yaml"])], ("list.yaml",), ()),
    ("deploy-render-out-inside-a-file", lambda p: [*_RENDER, "--config", str(p["good.yaml"]), "--out", str(p["a_file"] / "sub")], ("--out:", "which is a file"), ("a_file",)),
    ("deploy-render-a-file-in-the-way", lambda p: [*_RENDER, "--config", str(p["good.yaml"]), "--out", str(p["blocked"])], ("--out:", "k8s' is a file"), ("blocked",)),
    ("deploy-render-hosts-empty-entry", lambda p: ["deploy", "render", "--target", "onprem", "--accelerator", "gaudi3", "--nodes", "2", "--hosts", "node0,,node1", "--config", str(p["good.yaml"]), "--out", str(p["root"] / "r4")], ("--hosts:", "has an empty entry"), ()),
    ("prepare-bpe-vocab-huge", lambda p: _prepare(p, "--out", str(p["root"] / "d4"), "--tokenizer", "bpe", "--vocab-size", "2147483647"), ("tokenizer=bpe needs vocab_size from 256", "to 1,048,576"), ()),
    ("prepare-into-a-model-directory", lambda p: _prepare(p, "--out", str(p["hf_model"])), ("--out:", "is not a prepared dataset but holds tokenizer.json"), ("hf_model",)),
    ("health-hang-report-a-list", lambda p: ["health", str(p["hang_list"])], ("not a hang report (a JSON list, not an object)",), ()),
    ("health-hang-report-time", lambda p: ["health", str(p["hang_time"])], ("detected_unix_s 1e+30 is not a time",), ()),
    ("train-pp-zbv-with-compile", lambda p: [*_PP2, "--model.num_layers", "4", "--parallel.pp_schedule", "zbv", "--train.compile", "true"], ("train.compile: compiled blocks cannot run zbv's split backward", "allowed: train.compile with pp_schedule gpipe, 1f1b or interleaved_1f1b, or zbv with train.compile false"), ()),
    ("train-pp-split-without-brackets", lambda p: [*_PP2, "--model.num_layers", "4", "--parallel.pp_split", "7,15,24"], ("parallel.pp_split: expected a list of integers such as [7, 15, 24], got '7,15,24'",), ()),
    ("train-pp-1f1b-micro-batch-1", lambda p: [*_PP2, "--model.num_layers", "4", "--train.global_batch_size", "1"], ("is 1; allowed: a larger train.global_batch_size, or pp_schedule gpipe or zbv",), ()),
    ("train-pp-zbv-uneven-split", lambda p: [*_PP2, "--model.num_layers", "6", "--parallel.pp_schedule", "zbv"], ("parallel.pp_schedule: zbv runs 2 stages per rank, 4 with pp_size 2", "allowed: gpipe or 1f1b (one stage per rank), parallel.pp_split with 3 layer indices"), ()),
]  # fmt: skip

WORKED: list[Case] = [
    ("train-max-steps-text", lambda p: ["train", "--print-config", "--train.max_steps", "abc"], ("train.max_steps: expected an integer, got 'abc'",), ()),
    ("train-max-steps-negative", lambda p: ["train", "--print-config", "--train.max_steps", "-1"], ("train.max_steps: must be > 0",), ()),
    ("train-lr-zero", lambda p: ["train", "--print-config", "--optim.lr", "0"], ("optim.lr: must be > 0",), ()),
    ("train-unknown-field", lambda p: ["train", "--print-config", "--train.max_stepz", "3"], ("train.max_stepz: unknown field", "allowed:", "max_steps"), ()),
    ("train-null-field", lambda p: ["train", "--print-config", "--model.dim", "null"], ("model.dim: expected an integer, got None",), ()),
    ("train-precision-enum", lambda p: ["train", "--print-config", "--train.precision", "fp64"], ("allowed: auto, 32-true",), ()),
    ("train-fp8-recipe-enum", lambda p: ["train", "--print-config", "--train.fp8_recipe", "bogus"], ("train.fp8_recipe: got 'bogus'; allowed: tensorwise, rowwise, rowwise_with_gw_hp",), ()),
    ("train-fp8-recipe-without-fp8", lambda p: _train(p, "--train.fp8_recipe", "rowwise"), ("train.fp8_recipe: rowwise applies only with train.precision fp8, not auto", "default, tensorwise"), ()),
    ("train-fp8-skip-small-recipe", lambda p: ["train", "--print-config", "--train.precision", "fp8", "--train.fp8_recipe", "rowwise_with_gw_hp", "--train.fp8_skip_small_linears", "true"], ("train.fp8_skip_small_linears: true needs a recipe torchao has size thresholds for (tensorwise, rowwise), not train.fp8_recipe rowwise_with_gw_hp",), ()),
    ("train-fp8-head-without-fp8", lambda p: ["train", "--print-config", "--train.precision", "bf16-mixed", "--train.fp8_head", "true"], ("train.fp8_head: true applies only with train.precision fp8, not bf16-mixed",), ()),
    ("train-config-list", lambda p: ["train", "--print-config", "--config", str(p["list.yaml"])], ("must hold a mapping", "got a list"), ()),
    ("train-config-syntax", lambda p: ["train", "--print-config", "--config", str(p["syntax.yaml"])], ("not valid YAML at line 3",), ()),
    ("train-config-directory", lambda p: ["train", "--print-config", "--config", str(p["empty"])], ("--config", "is a directory"), ()),
    ("train-config-missing", lambda p: ["train", "--print-config", "--config", str(p["root"] / "nope.yaml")], ("does not exist",), ()),
    ("train-metrics-port", lambda p: ["train", "--print-config", "--monitor.metrics_port", "70000"], ("must be 0..65535",), ()),
    ("train-resume-missing", lambda p: _train(p, "--resume", str(p["root"] / "nope")), ("train.resume:", "allowed: auto, never, or a path"), ()),
    ("train-resume-empty-dir", lambda p: _train(p, "--resume", str(p["empty"])), ("train.resume:", "no committed manifest"), ()),
    ("train-resume-truncated", lambda p: _train(p, "--resume", str(p["trunc"])), ("train.resume:", "the manifest says"), ("trunc",)),
    ("train-resume-corrupt-manifest", lambda p: _train(p, "--resume", str(p["bad_manifest"])), ("train.resume:", "not valid JSON"), ("bad_manifest",)),
    ("train-remote-unknown-protocol", lambda p: _train(p, "--checkpoint.remote_url", "foo://x/y"), ("unknown protocol 'foo'", "allowed:"), ()),
    ("ckpt-export-out-not-empty", lambda p: ["ckpt", "export", str(p["step"]), "--out", str(p["export"])], ("is not empty", "--force"), ("export", "step")),
    ("ckpt-export-format", lambda p: ["ckpt", "export", str(p["step"]), "--out", str(p["root"] / "x2"), "--format", "onnx"], ("'onnx' is not one of 'safetensors', 'hf'",), ()),
    ("generate-truncated", lambda p: ["generate", str(p["trunc"])], ("is not usable", "the manifest says"), ("trunc",)),
    ("serve-kv-cache", lambda p: ["serve", str(p["step"]), "--kv-cache", "paged"], ("'paged' is not one of",), ()),
    ("deploy-render-edited-file", lambda p: [*_RENDER, "--config", str(p["good.yaml"]), "--out", str(p["rendered"])], ("exists and differs", "--force"), ("rendered",)),
    ("deploy-render-unknown-set", lambda p: [*_RENDER, "--config", str(p["good.yaml"]), "--out", str(p["root"] / "r2"), "--set", "bogus=1"], ("k8s.bogus: unknown field", "allowed:"), ()),
    ("deploy-render-target", lambda p: [*_RENDER[:2], "--target", "heroku", "--accelerator", "h100", "--nodes", "1", "--config", str(p["good.yaml"]), "--out", str(p["root"] / "r3")], ("--target: must be one of aws",), ()),
    ("benchmark-matrix", lambda p: ["benchmark", "run", "--matrix", "nosuch", "--out", str(p["root"] / "b")], ("shipped: cpu-small",), ()),
    ("cost-platform", lambda p: ["cost", "compare", "--model", "70B", "--tokens", "1T", "--platforms", "tpu"], ("unknown accelerator 'tpu'", "known:"), ()),
    ("dashboard-runs-file", lambda p: ["dashboard", "--runs", str(p["a_file"])], ("--runs:", "is not a directory"), ("a_file",)),
    ("doctor-check", lambda p: ["doctor", "--check", "gpu"], ("unknown check 'gpu'", "allowed: accelerator"), ()),
    ("unknown-verb", lambda p: ["trian"], ("No such command 'trian'", "Did you mean 'train'"), ()),
]  # fmt: skip


def _snapshot(p: dict[str, Path], names: tuple[str, ...]) -> dict[Path, bytes]:
    files: dict[Path, bytes] = {}
    for name in names:
        path = p[name]
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if f.is_file():
                files[f] = f.read_bytes()
    return files


@pytest.mark.parametrize(("args", "words", "keep"), [pytest.param(*c[1:], id=c[0]) for c in FIXED + WORKED])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(
    args: Args,
    words: tuple[str, ...],
    keep: tuple[str, ...],
    paths: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(paths["root"])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    argv = args(paths)
    before = _snapshot(paths, keep)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 2, (argv, err)
    assert out == "", out  # no half report before the refusal
    assert "Traceback" not in err
    assert err.startswith("gaudi3: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)
    assert _snapshot(paths, keep) == before


def test_serving_from_a_registry_that_is_not_there_creates_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow would make an empty file store at a mistyped --tracking-uri before saying the model is not in it."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = tmp_path / "mlruns-typo"
    with pytest.raises(SystemExit) as exited:
        main(["serve", "models:/tiny/1", "--tracking-uri", str(store)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert (
        err.startswith("gaudi3: error: models:/tiny/1: there is no MLflow store at")
        and "--tracking-uri" in err
    )
    assert not store.exists()


def test_plan_compare_shows_a_figure_that_is_not_a_number_as_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """summary.json spells non-finite figures "Infinity" and "NaN" (strict JSON); anything else not a number is
    shown as unknown too, never a TypeError."""
    (tmp_path / "summary.json").write_text(
        '{"predicted_step_time_s": 0.01, "step_time_s": "Infinity", "predicted_wall_s": "soon", "wall_s": 4.0,'
        ' "predicted_tokens_per_s": 100, "tokens_per_s": 80}'
    )
    main(["plan", "--compare", str(tmp_path)])
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["step_time_s"] == ["0.01", "s", "—", "—"]
    assert rows["wall_s"] == ["—", "4", "s", "—"]
    assert rows["tokens_per_s"] == ["100", "tokens/s", "80", "tokens/s", "+25.0%"]
