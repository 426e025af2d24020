"""`gaudi3 ckpt export`: safetensors bitwise equal to the checkpoint, Hugging Face Llama directories that
transformers loads with our logits, and one-line refusals that leave the output alone."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import click
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from gaudi3_scale.artifacts.export import EXPORT_FORMATS, TIED_ALIAS, load_exported
from gaudi3_scale.artifacts.inference import load_for_generation, read_model_state
from gaudi3_scale.artifacts.register import fetch_registered
from gaudi3_scale.cli.main import cli, main
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data import load_tokenizer
from gaudi3_scale.models import ModelConfig, Transformer, build_model, get_model_config
from gaudi3_scale.serve.loading import load_served_model, resolve_source
from gaudi3_scale.train.module import CONFIG_KEY

pytestmark = pytest.mark.integration

TRAIN = ["train", "--sample-tokens", "0", "--no-progress", "--train.val_every_steps", "0", "--model.name",
         "llama-tiny", "--optim.warmup_steps", "1", "--train.max_steps", "2", "--checkpoint.every_steps", "2",
         "--data.tokenizer", "bpe", "--data.vocab_size", "384"]  # fmt: skip
ATOL = 1e-5  # fp32; the kernels differ (SDPA vs HF eager attention, rotation order), so not bitwise


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed llama-tiny checkpoint (GQA, RoPE, untied; BPE tokenizer) from a real 2-step training run."""
    out = tmp_path_factory.mktemp("export") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", *TRAIN, "--out", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return out / "checkpoints" / "step-00000002"


def _save_plain_checkpoint(cfg: ModelConfig, path: Path) -> Transformer:
    """A Lightning-style checkpoint file of a random model whose biases and norm weights are not 0 / 1.

    With init's zeros and ones a mapping that swapped the two norms, or dropped a bias, would go unnoticed.
    """
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.3 * torch.randn_like(param))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, CONFIG_KEY: {"model": to_dict(cfg)}}, path)
    return model


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Run `gaudi3 ckpt export ARGS` in this process: (exit code, its stderr)."""
    capsys.readouterr()  # drop earlier output (transformers' loading progress bar)
    try:
        main(["ckpt", "export", *args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def _hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf, info = LlamaForCausalLM.from_pretrained(directory, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    assert hf.dtype == torch.float32
    with torch.no_grad():
        return hf.eval()(tokens).logits


def test_trained_llama_to_hf_and_safetensors(
    llama_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _ = load_for_generation(llama_ckpt)
    tokens = torch.randint(0, model.config.padded_vocab_size, (2, model.config.context_length))
    with torch.no_grad():
        ours = model(tokens)

    assert _export(capsys, str(llama_ckpt), "--out", str(tmp_path / "hf"), "--format", "hf") == (0, "")
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", tokens), ours, atol=ATOL, rtol=0)
    # The tokenizer travels with it: ours under tokenizer/, and at the top for transformers (and vLLM / TGI).
    text = "ROMEO:\nWhat light through yonder window breaks?"
    ids = load_tokenizer(llama_ckpt.parent.parent / "tokenizer").encode(text)
    assert load_tokenizer(tmp_path / "hf" / "tokenizer").encode(text) == ids
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert hf_tokenizer(text)["input_ids"] == ids and hf_tokenizer.decode(ids) == text
    with torch.no_grad():  # and it reads back into our model: the RoPE permutation undone exactly
        assert torch.equal(load_exported(tmp_path / "hf")(tokens), ours)

    assert _export(capsys, str(llama_ckpt), "--out", str(tmp_path / "st")) == (0, "")
    _, state = read_model_state(llama_ckpt)
    exported = load_file(tmp_path / "st" / "model.safetensors")
    assert sorted(exported) == sorted(state)
    for name, tensor in state.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    with torch.no_grad():
        assert torch.equal(load_exported(tmp_path / "st")(tokens), ours)


def test_tied_biased_padded_llama_to_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = replace(get_model_config("llama-tiny"), vocab_size=65, pad_vocab_to_multiple=16, bias=True,
                  tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-6)  # fmt: skip
    model = _save_plain_checkpoint(cfg, tmp_path / "tied.ckpt")
    assert _export(capsys, str(tmp_path / "tied.ckpt"), "--out", str(tmp_path / "hf"), "--format", "hf") == (
        0,
        "",
    )
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.context_length))
    with torch.no_grad():
        ours = model(tokens)
    assert ours.shape[-1] == 80
    # Without the 15 padding rows (transformers would sample them): the tokenizer's 65 logits, as ours.
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 65
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", tokens), ours[..., :65], atol=ATOL, rtol=0)
    back = load_exported(tmp_path / "hf")
    assert (back.config.padded_vocab_size, back.config.tie_embeddings, back.config.bias) == (65, True, True)
    assert (back.config.rope_theta, back.config.norm_eps, back.config.kv_heads) == (500000.0, 1e-6, 2)
    with torch.no_grad():
        assert torch.equal(back(tokens), ours[..., :65])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope type 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"head_dim": 8}, "head_dim 8 is not supported (only 16)"),
        (
            {"num_hidden_layers": None},
            "num_hidden_layers is None; a LlamaForCausalLM config needs an integer",
        ),
        (
            {"num_key_value_heads": 3},
            "not a model this project can build (num_kv_heads: must divide num_heads",
        ),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be > 0, got -1"),  # named as config.json names it
    ],
)
def test_hf_exports_we_cannot_compute_exactly_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object], message: str
) -> None:
    cfg = get_model_config("llama-tiny").resolve_vocab(65)
    _save_plain_checkpoint(cfg, tmp_path / "tiny.ckpt")
    assert (
        _export(capsys, str(tmp_path / "tiny.ckpt"), "--out", str(tmp_path / "hf"), "--format", "hf")[0] == 0
    )
    config_path = tmp_path / "hf" / "config.json"
    config = {**json.loads(config_path.read_text()), **change}
    config_path.write_text(json.dumps(config))
    with pytest.raises(UserInputError, match=re.escape(message)) as raised:
        load_exported(tmp_path / "hf")
    assert "\n" not in str(raised.value) and str(config_path) in str(raised.value)


def test_gpt2_exports_as_safetensors_but_not_as_hf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = get_model_config("shakespeare-char").resolve_vocab(65)
    model = _save_plain_checkpoint(cfg, tmp_path / "gpt2.ckpt")

    code, err = _export(capsys, str(tmp_path / "gpt2.ckpt"), "--out", str(tmp_path / "hf"), "--format", "hf")
    assert code == 2 and err.count("\n") == 1 and "arch 'gpt2'" in err and "--format safetensors" in err, err
    assert not (tmp_path / "hf").exists()

    assert _export(capsys, str(tmp_path / "gpt2.ckpt"), "--out", str(tmp_path / "st")) == (0, "")
    exported = load_file(tmp_path / "st" / "model.safetensors")
    assert sorted(exported) == sorted(set(model.state_dict()) - {TIED_ALIAS})  # the tied head is stored once
    tokens = torch.randint(0, 65, (2, cfg.context_length))
    with torch.no_grad():
        assert torch.equal(load_exported(tmp_path / "st")(tokens), model(tokens))


def test_existing_output_is_refused_unless_forced(
    llama_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = _export(capsys, str(llama_ckpt), "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and "not empty" in err and "--force" in err, err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    assert _export(capsys, str(llama_ckpt), "--out", str(out), "--force") == (0, "")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "model_config.json", "tokenizer"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or replaced directory left behind

    run = llama_ckpt.parent.parent
    code, err = _export(capsys, str(llama_ckpt), "--out", str(run), "--force")
    assert code == 2 and "contains the checkpoint" in err and llama_ckpt.is_dir(), err


def test_cli_choices_are_the_export_formats() -> None:
    export = cli.commands["ckpt"].commands["export"]  # type: ignore[attr-defined]
    (fmt,) = (p for p in export.params if p.name == "fmt")
    assert isinstance(fmt.type, click.Choice) and tuple(fmt.type.choices) == EXPORT_FORMATS


def test_register_round_trip(
    llama_ckpt: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    gaudi3_cli: Callable[..., tuple[int, str, str]],
) -> None:
    """Two registrations are versions 1 and 2 of one registered model; a version's artifacts load back as the
    same model, with the checkpoint's config as parameters and its step as a metric."""
    from mlflow.artifacts import download_artifacts

    from gaudi3_scale.monitor.trackers import mlflow_client

    uri = (tmp_path / "registry").as_uri()
    for version, fmt in ((1, "safetensors"), (2, "hf")):
        out = tmp_path / f"export-{version}"
        args = [
            str(llama_ckpt),
            "--out",
            str(out),
            "--format",
            fmt,
            "--register",
            "tiny-llama",
            "--tracking-uri",
            uri,
        ]
        assert _export(capsys, *args) == (0, "")
    client = mlflow_client(uri)
    versions = sorted(client.search_model_versions("name = 'tiny-llama'"), key=lambda v: int(v.version))
    assert [(int(v.version), v.tags["format"], v.tags["step"]) for v in versions] == [
        (1, "safetensors", "2"),
        (2, "hf", "2"),
    ]
    run = client.get_run(versions[0].run_id)
    assert run.data.params["model.name"] == "llama-tiny" and run.data.params["train.max_steps"] == "2"
    assert run.data.metrics["step"] == 2.0 and run.info.status == "FINISHED"
    assert run.data.tags["gaudi3.model.arch"] == "llama"

    source = client.get_model_version_download_uri("tiny-llama", "1")
    local = Path(download_artifacts(artifact_uri=source, dst_path=str(tmp_path / "dl")))
    model, _ = load_for_generation(llama_ckpt)
    tokens = torch.randint(0, model.config.padded_vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.equal(load_exported(local)(tokens), model(tokens))
    assert (local / "tokenizer" / "tokenizer.json").is_file()

    # What `gaudi3 serve models:/tiny-llama/2` loads: version 2 (format hf) fetched from the registry, then cached.
    cache = tmp_path / "cache"
    fetched = fetch_registered("models:/tiny-llama/2", uri, cache)
    served = load_served_model(resolve_source(fetched))
    with torch.no_grad():
        assert torch.equal(served.model(tokens), model(tokens))
    assert fetch_registered("models:/tiny-llama/2", uri, cache) == fetched  # reused, not downloaded again
    assert [p.name for p in fetched.parent.iterdir()] == ["2"]  # no temporary directory left behind
    capsys.readouterr()  # MLflow's download progress bar
    for bad, message in [
        ("models:/tiny-llama/9", "no such model version in file:"),
        ("models:/tiny-llama", "models:/NAME/VERSION"),
        ("models:/nobody/1", "(versions of 'nobody': none)"),
    ]:
        code, out, err = gaudi3_cli("serve", bad, "--tracking-uri", uri, "--port", "0")
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, (bad, err)
    code, _, err = gaudi3_cli("serve", str(fetched), "--tracking-uri", uri)
    assert code == 2 and "--tracking-uri is for a registered model argument" in err


@pytest.mark.parametrize(
    ("name", "uri", "expected"),
    [
        ("bad name/", None, "not a usable model name"),
        ("tiny", "http://127.0.0.1:9", "is not usable"),  # nothing listens on the discard port
    ],
)
def test_register_refusals_write_nothing(
    llama_ckpt: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    uri: str | None,
    expected: str,
) -> None:
    out = tmp_path / "out"
    args = [str(llama_ckpt), "--out", str(out), "--register", name]
    code, err = _export(capsys, *args, *(("--tracking-uri", uri) if uri else ()))
    assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert not out.exists() and not (llama_ckpt.parent.parent / "mlruns").exists()


def test_register_with_a_damaged_run_summary_writes_nothing_and_a_rerun_after_the_repair_works(
    llama_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """summary.json (the run's metrics the version is logged with) is read before the export is written: a
    damaged one is one line and nothing written, so the same command works once it is repaired."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    shutil.copytree(llama_ckpt.parent.parent, run)
    summary = run / "summary.json"
    intact = summary.read_bytes()
    out = tmp_path / "out"
    args = [str(run / "checkpoints" / llama_ckpt.name), "--out", str(out), "--register", "tiny"]
    for damaged in (intact[:50], b"[1, 2]\n"):  # cut short (a killed write), or not a mapping
        summary.write_bytes(damaged)
        code, err = _export(capsys, *args)
        assert not out.exists() and not (run / "mlruns").exists()
        assert code == 2 and err.count("\n") == 1 and f"run summary {str(summary)!r}" in err, err
        assert "repair it, or move it away" in err
    summary.write_bytes(intact)
    assert _export(capsys, *args) == (0, "")
    assert (out / "model.safetensors").is_file() and (run / "mlruns").is_dir()


def test_register_of_a_light_checkpoint_defaults_to_the_runs_registry(
    llama_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --tracking-uri, a checkpoint in <run>/light_checkpoints/ registers into <run>/mlruns, the store
    its run's full checkpoints use (one registry, one line of version numbers)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    shutil.copytree(llama_ckpt.parent.parent, run)
    light = run / "light_checkpoints" / llama_ckpt.name
    light.parent.mkdir()
    (run / "checkpoints" / llama_ckpt.name).rename(light)
    assert _export(capsys, str(light), "--out", str(tmp_path / "out"), "--register", "tiny-light") == (0, "")
    assert (run / "mlruns").is_dir() and not (light.parent / "mlruns").exists()
