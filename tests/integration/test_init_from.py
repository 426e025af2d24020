"""`model.init_from`: Hugging Face Llama / Mixtral / GPT-2 checkpoints (made here with transformers, random weights, sharded
into several files and as one file) load into our model with transformers' logits; the config comes from the
checkpoint; bad directories are one line and exit 2 with nothing written; a run fine-tuned from one resumes,
exports and serves. The 2-rank FSDP and tensor-parallel layouts are tests/distributed/test_init_from_sharded.py."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from gaudi3_scale.artifacts.export import load_exported
from gaudi3_scale.cli.main import main
from gaudi3_scale.config.core import save_yaml
from gaudi3_scale.config.errors import ConfigError, brief
from gaudi3_scale.models.pretrained import open_pretrained
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.train.trainer import GaudiTrainer
from hf_checkpoints import hf_model, load_ours, save_hf_checkpoints, save_tokenizer

pytestmark = pytest.mark.integration

ATOL = 1e-5  # fp32; SDPA vs HF eager attention and a different rotation order: close, not bitwise
TEXT = "ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet is the sun.\n" * 20


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = save_hf_checkpoints(tmp_path_factory.mktemp("hf"))
    save_tokenizer(dirs["llama-sharded"], TEXT)
    return dirs


def test_hf_checkpoints_load_with_transformers_logits(hf_dirs: dict[str, Path]) -> None:
    assert len(list(hf_dirs["llama-sharded"].glob("*.safetensors"))) > 2  # really sharded
    assert len(list(hf_dirs["gpt2-sharded"].glob("*.safetensors"))) > 2
    assert "lm_head.weight" in load_file(hf_dirs["gpt2-untied"] / "model.safetensors")
    tokens = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    for name, directory in hf_dirs.items():
        ours = load_ours(directory)
        with torch.no_grad():
            expected = hf_model(directory)(tokens).logits
            torch.testing.assert_close(ours(tokens), expected, atol=ATOL, rtol=0, msg=name)
    config = load_ours(hf_dirs["llama-tied-bias"]).config
    assert (config.tie_embeddings, config.bias, config.rope_theta, config.kv_heads) == (
        True,
        True,
        500000.0,
        2,
    )
    config = load_ours(hf_dirs["mixtral-sharded"]).config  # MixtralForCausalLM: llama blocks with experts
    assert (config.arch, config.num_experts, config.experts_per_token, config.hidden_dim) == (
        "llama",
        4,
        2,
        64,
    )
    config = load_ours(hf_dirs["gpt2-sharded"]).config
    assert (config.arch, config.activation, config.tie_embeddings, config.hidden_dim) == ("gpt2", "gelu_tanh",
                                                                                          True, 128)  # fmt: skip

    # Vocabulary padding (device default 64 on GPUs): the checkpoint's rows load, the 31 padding rows get the
    # seeded init; a shorter context reads the first rows of GPT-2's position table.
    padded = load_ours(hf_dirs["gpt2-sharded"], pad_vocab_to_multiple=64, context_length=16)
    assert padded.tok_embeddings.weight.shape == (128, 32) and padded.pos_embeddings is not None
    assert padded.pos_embeddings.weight.shape == (16, 32)
    assert 0.01 < float(padded.tok_embeddings.weight[97:].detach().std()) < 0.03  # N(0, 0.02)
    with torch.no_grad():
        expected = hf_model(hf_dirs["gpt2-sharded"])(tokens[:, :16]).logits
        torch.testing.assert_close(padded(tokens[:, :16])[..., :97], expected, atol=ATOL, rtol=0)


def test_any_rectangle_reads_what_the_whole_tensor_holds(hf_dirs: dict[str, Path]) -> None:
    """Blocks that cut through a RoPE head (wk: 2 heads of 8 rows), a column range of a transposed, fused GPT-2
    c_attn (wv's columns), and plain rows: each equals the same rectangle of the whole mapped tensor."""
    from safetensors import safe_open

    from gaudi3_scale.models.hf import permute_rope_rows
    from gaudi3_scale.models.pretrained_reader import _read_block

    for name, param, rows, cols in [
        ("llama-tied-bias", "layers.1.attention.wk.weight", (3, 13), (5, 30)),
        ("llama-tied-bias", "layers.0.attention.wq.bias", (7, 9), None),
        ("gpt2-sharded", "layers.0.attention.wv.weight", (2, 31), (1, 17)),
        ("gpt2-sharded", "layers.1.attention.wk.bias", (4, 20), None),
        ("gpt2-sharded", "pos_embeddings.weight", (10, 40), (0, 32)),
    ]:
        checkpoint = open_pretrained(hf_dirs[name])
        source = checkpoint.sources[param]
        with safe_open(str(checkpoint.files[source.name]), framework="pt") as handle:
            whole = handle.get_tensor(source.name)
            got = _read_block(handle.get_slice(source.name), source, rows, cols)
        if source.rope_heads:
            whole = permute_rope_rows(whole, source.rope_heads, to_hf=False)
        if source.transposed:
            whole = whole.t()
        whole = whole[source.offset :]
        expected = whole[rows[0] : rows[1]] if cols is None else whole[rows[0] : rows[1], cols[0] : cols[1]]
        assert torch.equal(got, expected), (name, param)


def test_config_comes_from_the_checkpoint(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = hf_dirs["llama-sharded"]
    cfg = build_run_config(None, [("model.init_from", str(directory)), ("model.context_length", "32")])
    shape = (cfg.model.arch, cfg.model.num_layers, cfg.model.dim, cfg.model.kv_heads, cfg.model.vocab_size)
    assert (
        shape == ("llama", 2, 32, 2, 257) and cfg.model.context_length == 32 and not cfg.model.tie_embeddings
    )
    # The tokenizer beside it prepares the data.
    assert cfg.data.tokenizer == str(directory / "tokenizer.json")
    assert cfg.name == cfg.model.name == "llama-sharded"  # runs/llama-sharded/, not the default preset's
    save_yaml(cfg, tmp_path / "config.yaml")  # the resolved config a run writes builds the same config again
    assert build_run_config(tmp_path / "config.yaml") == cfg
    explicit = build_run_config(None, [("model.init_from", str(directory)), ("data.tokenizer", "byte")])
    assert explicit.data.tokenizer == "byte" and explicit.model.context_length == 64  # the user's wins
    agreeing = build_run_config(None, [("model.init_from", str(directory)), ("model.dim", "32")])
    assert agreeing.model.dim == 32
    for field, value, message in [
        ("model.dim", "64", f"model.dim: 64 disagrees with model.init_from {directory} (32); leave it unset"),
        ("model.arch", "gpt2", "model.arch: 'gpt2' disagrees with model.init_from"),
        ("model.num_kv_heads", "4", "model.num_kv_heads: 4 disagrees"),
        ("model.context_length", "128", "model.context_length: 128 exceeds model.init_from"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            build_run_config(None, [("model.init_from", str(directory)), (field, value)])


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def _broken(tmp_path: Path, source: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def test_bad_checkpoints_are_one_line_exit_2_and_write_nothing(
    hf_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sharded = hf_dirs["llama-sharded"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    a_shard = sorted(set(index["weight_map"].values()))[1]
    cases: dict[str, tuple[Path, str]] = {}
    cases["missing"] = (tmp_path / "absent", "is not a directory; allowed: a Hugging Face checkpoint")
    no_config = _broken(tmp_path, sharded, "no-config")
    (no_config / "config.json").unlink()
    cases["no config"] = (no_config, "has neither config.json (Hugging Face) nor model_config.json")
    partial = _broken(tmp_path, sharded, "partial")
    (partial / a_shard).unlink()
    cases["partial"] = (partial, f"lists shard '{a_shard}', which is missing")
    for model_type in ("mistral", "t5"):  # bert is supported: tests/integration/test_bert.py
        other = _broken(tmp_path, sharded, model_type)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        cases[model_type] = (other, f"model_type '{model_type}' is not supported; allowed: Llama")
    truncated = _broken(tmp_path, hf_dirs["gpt2-untied"], "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (truncated, "model.safetensors is not a readable safetensors file")
    garbage = _broken(tmp_path, sharded, "garbage")
    (garbage / a_shard).write_bytes(b"\xff" * 64)
    cases["garbage"] = (garbage, f"{a_shard} is not a readable safetensors file")
    shape = _broken(tmp_path, hf_dirs["gpt2-untied"], "shape")
    tensors = load_file(shape / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"][
        :, :100
    ].contiguous()
    save_file(tensors, shape / "model.safetensors", metadata={"format": "pt"})
    cases["shape"] = (shape, "tensor 'transformer.h.1.mlp.c_fc.weight' in")
    missing = _broken(tmp_path, sharded, "missing-tensor")
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (missing / "model.safetensors.index.json").write_text(json.dumps(index))
    cases["tensor missing"] = (missing, "tensor 'model.layers.1.mlp.up_proj.weight' is missing from any file")
    for key, value, kind in [("rope_theta", "abc", "a finite number"), ("rope_scaling", [1], "an object"),
                             ("tie_word_embeddings", "false", "true or false")]:  # fmt: skip
        typo = _broken(tmp_path, sharded, f"typed-{key}")
        config = json.loads((typo / "config.json").read_text())
        (typo / "config.json").write_text(json.dumps({**config, key: value}))
        cases[f"{key} {value}"] = (typo, f"{key} is {brief(value)}; a config.json has {kind}")
    for what, (directory, message) in cases.items():
        out = tmp_path / "runs" / what.replace(" ", "-")
        args = ["train", "--model.init_from", str(directory), "--out", str(out), "--train.max_steps", "1"]
        code, err = _cli([*args, "--no-progress", "--sample-tokens", "0"], capsys)
        assert code == 2 and err.count("\n") == 1 and "model.init_from" in err, (what, err)
        assert message in err, (what, err)
        assert not out.exists(), what  # refused before the run directory is written
    assert (
        "has shape [32, 100], but the checkpoint's config implies [32, 128]"
        in _cli(
            ["train", "--model.init_from", str(shape), "--out", str(tmp_path / "x"), "--no-progress"], capsys
        )[1]
    )


def test_a_float_size_in_a_real_config_is_one_line_from_the_cli(
    hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """`n_inner: 128.0` (GPT-2's own 4 * n_embd, as a float) crashed deep in nn.Linear with a traceback and exit 1;
    now `gaudi3 train` in a fresh process prints one line and exits 2. The other checks of a checkpoint's config and
    tensors are tests/unit/test_pretrained_checks.py."""
    directory = _broken(tmp_path, hf_dirs["gpt2-untied"], "float-n-inner")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "n_inner": 128.0}))
    args = ["train", "--model.init_from", str(directory), "--out", str(tmp_path / "run"), "--train.max_steps", "1",
            "--no-progress", "--sample-tokens", "0"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-3000:]
    assert done.stderr == (
        f"gaudi3: error: model.init_from {directory / 'config.json'}: n_inner is 128.0; a GPT2LMHeadModel config "
        "needs an integer or null there\n"
    )
    assert not (tmp_path / "run").exists()


def test_fine_tune_from_hf_then_resume_export_and_serve(
    hf_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = hf_dirs["llama-sharded"]
    (tmp_path / "text.txt").write_text(TEXT)
    overrides = [("model.init_from", str(directory)), ("model.context_length", "32"), ("optim.lr", "1e-30"),
                 ("optim.min_lr", "0"), ("optim.warmup_steps", "0"), ("train.global_batch_size", "4"),
                 ("train.micro_batch_size", "4"), ("train.max_steps", "2"), ("train.val_every_steps", "2"),
                 ("train.val_batches", "1"), ("train.log_every_steps", "1"), ("checkpoint.every_steps", "2"),
                 ("data.source", str(tmp_path / "text.txt")), ("data.prepared_dir", str(tmp_path / "prepared")),
                 ("out_dir", str(tmp_path / "run"))]  # fmt: skip
    trainer = GaudiTrainer(build_run_config(None, overrides), progress=False)
    summary = trainer.fit()
    assert trainer.module.init_from == str(directory)  # type: ignore[union-attr]
    # lr 1e-30 (0 is refused): below every weight's ulp, so the weights stay the HF ones, and the run's val loss is the HF model's loss on the same batch (the first val window).
    batch = next(iter(trainer.datamodule.val_dataloader()))  # type: ignore[union-attr]
    hf = hf_model(directory)
    with torch.no_grad():
        logits = hf(batch[0]).logits
        hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
    assert summary["val_loss"] == pytest.approx(float(hf_loss), abs=1e-5)
    assert math.isfinite(summary["train_loss"])

    # Resume: the checkpoint wins and init_from is not read again.
    longer = [(k, "3" if k == "train.max_steps" else v) for k, v in overrides]
    resumed_cfg = build_run_config(None, longer)
    resumed = GaudiTrainer(resumed_cfg, progress=False)
    assert resumed.fit()["steps"] == 3 and resumed.module.init_from is None  # type: ignore[union-attr]

    # Export (both formats) and load them as serving does: still the HF model's logits.
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000003"
    tokens = batch[0][:2]
    for fmt in ("hf", "safetensors"):
        code, err = _cli(
            ["ckpt", "export", str(checkpoint), "--out", str(tmp_path / fmt), "--format", fmt], capsys
        )
        assert code == 0, err
        with torch.no_grad():
            torch.testing.assert_close(
                load_exported(tmp_path / fmt)(tokens), hf(tokens).logits, atol=ATOL, rtol=0
            )
    # An export is a valid init_from too (our safetensors format), with the tokenizer under tokenizer/.
    again = build_run_config(None, [("model.init_from", str(tmp_path / "safetensors"))])
    assert again.data.tokenizer == str(tmp_path / "safetensors" / "tokenizer" / "tokenizer.json")
    assert load_ours(tmp_path / "safetensors").config.vocab_size == 257


def test_a_dataset_vocabulary_larger_than_the_checkpoints_is_refused(
    hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "text.txt").write_text(TEXT)
    directory = hf_dirs["gpt2-sharded"]  # 97 rows; the byte tokenizer has 256 tokens
    overrides = [("model.init_from", str(directory)), ("data.tokenizer", "byte"),
                 ("data.source", str(tmp_path / "text.txt")), ("data.prepared_dir", str(tmp_path / "prepared")),
                 ("out_dir", str(tmp_path / "run")), ("train.max_steps", "1")]  # fmt: skip
    message = f"model.init_from: {directory} has a vocabulary of 97 tokens but the dataset's tokenizer 256"
    with pytest.raises(ConfigError, match=re.escape(message)):
        GaudiTrainer(build_run_config(None, overrides), progress=False).fit()
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_model_with_more_rows_than_the_byte_tokenizer_trains_and_prints_its_sample(tmp_path: Path) -> None:
    """A Hugging Face model of vocabulary 320 fine-tuned with the byte tokenizer (256 tokens; ids 256..319 never
    occur in the data) trains, saves and prints its end-of-run sample, drawn from ids the tokenizer decodes: it
    exited 1 with a traceback there, after the run was saved."""
    directory = tmp_path / "llama-320"
    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(LlamaConfig(vocab_size=320, **shape)).save_pretrained(directory)
    (tmp_path / "text.txt").write_text(TEXT)
    args = ["train", "--model.init_from", str(directory), "--data.tokenizer", "byte", "--data.source",
            str(tmp_path / "text.txt"), "--data.prepared_dir", str(tmp_path / "prepared"), "--out",
            str(tmp_path / "run"), "--model.context_length", "32", "--train.global_batch_size", "2",
            "--train.micro_batch_size", "2", "--train.max_steps", "1", "--train.val_every_steps", "0",
            "--no-progress", "--sample-tokens", "64"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    sample = done.stdout.split("---- sample ----\n", 1)[1]
    assert len(sample.encode()) >= 64  # the newline it starts from and 64 decoded bytes
