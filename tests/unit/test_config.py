"""Run config: YAML + dotted overrides + preset expansion, and one clear line for every mistake."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gaudi3_scale.config import ConfigError, UserInputError
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.train.config import RunConfig, build_run_config


def test_defaults_are_the_published_shakespeare_char_run() -> None:
    cfg = build_run_config()
    assert (cfg.model.num_layers, cfg.model.num_heads, cfg.model.dim, cfg.model.context_length) == (
        4,
        4,
        128,
        64,
    )
    assert cfg.train.global_batch_size == 12 and cfg.train.max_steps == 2000
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps) == (1e-3, 1e-4, 100)
    assert (cfg.optim.beta2, cfg.optim.weight_decay, cfg.optim.grad_clip_norm) == (0.99, 0.1, 1.0)
    assert cfg.model.dropout == 0.0
    assert cfg.output_dir == Path("runs/shakespeare-char")


def test_yaml_then_overrides_then_preset(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "gpt2-124m", "dropout": 0.1}, "optim": {"lr": 6e-4}}))
    cfg = build_run_config(path, parse_overrides(["--model.num_layers", "6", "--optim.min_lr=6e-5"]))
    assert cfg.model.num_layers == 6  # CLI beats preset
    assert cfg.model.dim == 768 and cfg.model.vocab_size == 50257  # preset fills the rest
    assert cfg.model.dropout == 0.1  # YAML beats preset
    assert cfg.optim.lr == 6e-4 and cfg.optim.min_lr == 6e-5


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        (["--model.num_layer", "3"], "model.num_layer", "num_layers"),
        (["--train.max_steps", "ten"], "train.max_steps", "integer"),
        (["--train.max_steps", "0"], "train.max_steps", "> 0"),
        (["--train.precision", "int8"], "train.precision", "bf16-mixed"),
        (["--model.dim", "130"], "model.dim", "divisible by num_heads"),
        (["--train.micro_batch_size", "5"], "train.micro_batch_size", "divide global_batch_size"),
        (["--optim.min_lr", "0.1"], "optim.min_lr", "<= lr"),
        (["--model.name", "gpt5"], "model.name", "shakespeare-char"),
        (["--model.dropout", "1.5"], "model.dropout", "between 0.0 and 1.0"),
        (["--optim.lr", "nan"], "optim.lr", "number"),
        (["--train.global_batch_tokens", "100"], "train.global_batch_tokens", "nearest valid: 64 or 128"),
        (["--parallel.strategy", "zero9"], "parallel.strategy", "deepspeed_zero2, deepspeed_zero3"),
        (
            ["--parallel.strategy", "deepspeed_zero3", "--train.compile", "true"],
            "train.compile",
            "deepspeed_zero2",
        ),
        (["--model.pad_vocab_to_multiple", "48"], "model.pad_vocab_to_multiple", "positive power of two"),
        (["--model.pad_vocab_to_multiple", "0"], "model.pad_vocab_to_multiple", "positive power of two"),
        (["--model.rope_theta", "1"], "model.rope_theta", "must be > 1, got 1"),
        (
            ["--parallel.strategy=fsdp", "--train.precision=16-mixed"],
            "train.precision",
            "not with parallel.strategy fsdp; use bf16-mixed",
        ),
        (["--model.rope_theta", "1e-45"], "model.rope_theta", "must be > 1, got 1e-45"),
        (
            ["--model.name=llama-tiny", "--model.num_heads=4", "--model.num_kv_heads=1", "--model.dim=36"],
            "model.dim",
            "got 36 / 4 = 9; allowed: a dim that is an even multiple of num_heads",
        ),
        (["--train.throughput_warmup_steps", "2000"], "train.throughput_warmup_steps", "0 to 1999"),
        (["--train.throughput_warmup_steps", "-1"], "train.throughput_warmup_steps", ">= 0"),
        (["--train.compile_mode", "reduce-overhead"], "train.compile_mode", "train.compile true"),
        (["--train.compile_mode", "fast"], "train.compile_mode", "reduce-overhead"),
        (
            [
                "--train.compile",
                "true",
                "--train.compile_mode",
                "reduce-overhead",
                "--parallel.strategy",
                "fsdp",
            ],
            "train.compile_mode",
            "auto, single or ddp",
        ),
    ],
)
def test_bad_values_name_the_field_and_what_is_allowed(
    overrides: list[str], field: str, allowed: str
) -> None:
    with pytest.raises(UserInputError) as info:
        build_run_config(None, parse_overrides(overrides))
    message = str(info.value)
    assert message.startswith(field), message
    assert allowed in message
    assert "\n" not in message


def test_print_config_of_a_run_in_epochs_reads_back(tmp_path: Path, gaudi3_cli: Callable[..., tuple]) -> None:
    """--print-config is a config file: with train.max_epochs set its max_steps is null (the resolved value is a
    placeholder until the data is opened), so `--config` reads it back instead of refusing both set."""
    code, printed, err = gaudi3_cli("train", "--train.max_epochs=3", "--print-config")
    assert code == 0, err
    train = yaml.safe_load(printed)["train"]
    assert (train["max_epochs"], train["max_steps"]) == (3, None)
    (tmp_path / "printed.yaml").write_text(printed)
    assert gaudi3_cli("train", "--config", str(tmp_path / "printed.yaml"), "--print-config") == (
        0,
        printed,
        "",
    )


@pytest.mark.parametrize(
    "name", ["..", ".", ".hidden", "a/b", "a\\b", "a b", "a\nb", "", "x" * 129, "café", "run\x00", "-rf"]
)
def test_a_run_name_is_one_safe_path_component(name: str) -> None:
    with pytest.raises(ConfigError, match=r"^name: must be 1 to 128 letters, digits"):
        RunConfig(name=name)


@pytest.mark.parametrize("name", ["shakespeare-char", "llama3.2-1b", "run_2", "A.b-c_9", "x" * 128, "7"])
def test_good_run_names_pass(name: str) -> None:
    assert RunConfig(name=name).output_dir == Path("runs") / name


def test_the_run_name_defaults_to_the_model_preset(tmp_path: Path) -> None:
    assert build_run_config(None, parse_overrides(["--model.name", "gpt2-124m"])).output_dir == Path(
        "runs/gpt2-124m"
    )
    path = tmp_path / "run.yaml"
    path.write_text("model: {name: llama-tiny}\n")
    assert build_run_config(path).name == "llama-tiny"
    path.write_text("name: mine\nmodel: {name: llama-tiny}\n")
    assert build_run_config(path).name == "mine"  # a named run keeps its name


def test_a_matrix_without_its_required_name_is_one_line(tmp_path: Path) -> None:
    from gaudi3_scale.bench.matrix import load_matrix

    path = tmp_path / "m.yaml"
    path.write_text("description: no name\n")
    with pytest.raises(UserInputError, match=r"m\.yaml: name: is required: the matrix's name"):
        load_matrix(path)


def test_unknown_yaml_section(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"^trainer: unknown field; allowed: .*train"):
        build_run_config(path)


def test_yaml_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(UserInputError, match="must hold a mapping"):
        build_run_config(path)
    path.write_text("model: {num_layers: [\n")
    with pytest.raises(UserInputError, match="not valid YAML at line"):
        build_run_config(path)
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(UserInputError, match=r"is not UTF-8 text: byte 0xe9 at offset 9 \(line 1\)"):
        build_run_config(path)


def test_gradient_accumulation_is_derived_and_checked() -> None:
    cfg = build_run_config(
        None, parse_overrides(["--train.global_batch_size", "48", "--train.micro_batch_size", "6"])
    )
    assert cfg.batch_plan(world_size=1).accumulation == 8
    assert cfg.batch_plan(world_size=2).accumulation == 4
    with pytest.raises(ConfigError, match="not divisible by micro_batch_size"):
        cfg.batch_plan(world_size=5)


def test_round_trip_through_yaml(tmp_path: Path) -> None:
    from gaudi3_scale.config.core import save_yaml

    cfg = build_run_config(None, parse_overrides(["--model.num_layers", "2", "--train.max_steps", "7"]))
    save_yaml(cfg, tmp_path / "config.yaml")
    again = build_run_config(tmp_path / "config.yaml")
    assert again == cfg
    assert isinstance(again, RunConfig)


_FIELDS = [
    "model.num_layers",
    "model.dim",
    "model.dropout",
    "train.max_steps",
    "train.precision",
    "optim.lr",
    "train.global_batch_size",
    "train.global_batch_tokens",
    "data.val_fraction",
    "model.arch",
    "name",
    "model.nope",
    "x.y",
    "train",
]


_HOSTILE = ["9" * 5000, "1e300", "1e400", "nan", "-inf", "{a: " * 200, "[" * 3000, "&a [*a]", "2020-13-45", "\x00",
            "!!binary aGVsbG8=", "!!set {a}", "0b" + "1" * 300, "1:2:3:4:5", "..", "a\nb"]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    key=st.sampled_from(_FIELDS) | st.text(min_size=1, max_size=12),
    value=st.text(max_size=12)
    | st.integers(-5, 10**6).map(str)
    | st.floats(allow_nan=True).map(str)
    | st.integers(-(2**80), 2**80).map(str)
    | st.sampled_from(_HOSTILE),
)
def test_fuzzed_overrides_never_raise_anything_but_user_errors(key: str, value: str) -> None:
    try:
        build_run_config(None, [(key, value)])
    except UserInputError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 500


@pytest.mark.parametrize("value", ["١٢", "１２", "1_000.5", "nan", "infinity"])
def test_numbers_on_the_command_line_are_plain_ascii(value: str) -> None:
    """float() takes Arabic-Indic and full-width digits; an override must not (the CLI's own flags do not)."""
    with pytest.raises(ConfigError, match=r"^seed: expected an integer"):
        build_run_config(None, [("seed", value)])
    assert build_run_config(None, [("optim.lr", "3e-4")]).optim.lr == 3e-4  # YAML 1.1 reads it as text


def test_an_empty_section_means_its_defaults(tmp_path: Path) -> None:
    """`data:` with every field below it commented out is null in YAML: the section's defaults, in every section
    (model and train always read it so); a section that is neither a mapping nor empty is still refused."""
    import dataclasses

    default = build_run_config()
    sections = [f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(f.type)
                or (isinstance(f.type, str) and dataclasses.is_dataclass(getattr(default, f.name)))]  # fmt: skip
    assert {"model", "data", "optim", "train", "parallel", "checkpoint", "monitor", "cost"} <= set(sections)
    path = tmp_path / "run.yaml"
    path.write_text("".join(f"{name}:\n  # lr: 3e-4\n" for name in sections))
    assert build_run_config(path) == default
    path.write_text("data: 5\n")
    with pytest.raises(ConfigError, match=r"^data: expected a mapping of fields, got 5$"):
        build_run_config(path)


def test_a_global_batch_that_does_not_split_over_the_ranks_says_why(
    gaudi3_cli: Callable[..., tuple[int, str, str]],
) -> None:
    """Before: "8 is not divisible by micro_batch_size (0) × ranks (16) = 0", a micro-batch nobody set."""
    code, out, err = gaudi3_cli(
        "train", "--dry-run", "--nproc-per-node", "16", "--train.global_batch_size", "8"
    )
    assert code == 2 and out == ""
    assert err == (
        "gaudi3: error: train.global_batch_size: 8 sequences are fewer than the 16 data-parallel ranks (each rank "
        "needs at least one); allowed: a multiple of 16\n"
    )
    cfg = build_run_config(None, parse_overrides(["--train.global_batch_size", "20"]))
    with pytest.raises(ConfigError) as info:
        cfg.batch_plan(world_size=16)
    assert str(info.value) == (
        "train.global_batch_size: 20 is not divisible by the 16 data-parallel ranks; allowed: a multiple of 16"
    )
    micro = build_run_config(
        None, parse_overrides(["--train.global_batch_size", "8", "--train.micro_batch_size", "2"])
    )
    with pytest.raises(ConfigError) as info:
        micro.batch_plan(world_size=16)
    assert str(info.value) == (
        "train.global_batch_size: 8 sequences are fewer than train.micro_batch_size 2 × 16 data-parallel ranks = "
        "32 (each rank needs at least one micro-batch); allowed: a multiple of 32"
    )


def test_an_integer_bound_is_printed_as_the_integer(gaudi3_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, _, err = gaudi3_cli("train", "--print-config", "--parallel.nproc_per_node", "3000000000")
    assert code == 2
    assert err == "gaudi3: error: parallel.nproc_per_node: must be <= 2147483647, got 3000000000\n"
    assert "2.14748e+09" not in err


def test_numbers_with_an_exponent_are_numbers_in_yaml_files_and_nested_values(
    tmp_path: Path, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    """YAML 1.1 (PyYAML) reads 3e-4 and 1e308 as strings; a float field takes them as the numbers they are."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "optim: {lr: 3e-4}\ndata:\n  mixture: [{source: a, weight: 1e308}, {source: b, weight: 1}]\n"
    )
    cfg = build_run_config(path)
    assert cfg.optim.lr == 3e-4
    assert cfg.data.mixture is not None and [m.weight for m in cfg.data.mixture] == [1e308, 1.0]
    member = "[{source: a, weight: %s}, {source: b, weight: %s}]"
    code, _, err = gaudi3_cli("train", "--print-config", "--data.mixture", member % ("1e309", "1"))
    assert code == 2 and err == "gaudi3: error: data.mixture[0].weight: must be a finite number, got inf\n"
    code, _, err = gaudi3_cli("train", "--print-config", "--data.mixture", member % ("1e308", "1e308"))
    assert code == 2 and "expected a number" not in err
    assert err == (
        "gaudi3: error: data.mixture: the weights sum past the largest float (1.8e+308); weights are relative "
        "(7, 2, 1 is 70 % / 20 % / 10 %): scale them down\n"
    )
    code, _, err = gaudi3_cli("train", "--print-config", "--data.mixture", member % ("heavy", "1"))
    assert code == 2 and err == "gaudi3: error: data.mixture[0].weight: expected a number, got 'heavy'\n"


def test_a_choice_spelled_like_a_yaml_boolean_stays_the_word() -> None:
    """YAML 1.1 reads `off` as false: a choice field that allows "off" takes it back as the word, in a file and on
    the command line; where no allowed word matches, the boolean is refused as before."""
    from gaudi3_scale.train.config import resolve_config

    assert resolve_config(None, ["--health.spike_policy", "off"]).health.spike_policy == "off"
    with pytest.raises(
        ConfigError, match=r"^health.spike_policy: got True; allowed: off, warn, skip, rollback$"
    ):
        resolve_config(None, ["--health.spike_policy", "on"])
