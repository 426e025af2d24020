"""Pipeline-parallel settings: checked against the launch geometry, the strategy, the model's layers and the
schedules' micro-batch limits, one line each naming the field; the plans divide the world into pipelines and
tensor-parallel groups, and a stage holds the layers the split gives it."""

from __future__ import annotations

import pytest

from gaudi3_scale.config import ConfigError
from gaudi3_scale.distributed.mesh import data_parallel_rank
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.distributed.stages import local_stages, stage_layers
from gaudi3_scale.train.config import RunConfig
from gaudi3_scale.train.config import build_run_config as _build


def build_run_config(overrides: list[str]) -> RunConfig:
    return _build(overrides=[tuple(item.split("=", 1)) for item in overrides])  # type: ignore[misc]


# llama-tiny has 2 layers; 4 of them give interleaved schedules 2 stages on each of 2 ranks.
LLAMA4 = [
    "model.name=llama-tiny",
    "model.num_layers=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
]
PP2 = [*LLAMA4, "parallel.nproc_per_node=2", "parallel.pp_size=2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([*LLAMA4, "parallel.nproc_per_node=4", "parallel.pp_size=3"],
         r"^parallel\.pp_size: must divide world_size / tp_size \(4 / 1 = 4\)"),
        ([*PP2, "model.num_layers=3"],
         r"^parallel\.pp_size: the automatic split needs model\.num_layers \(3\) to be a multiple of the 2 "),
        ([*LLAMA4, "parallel.nproc_per_node=8", "parallel.pp_size=8"],
         r"^parallel\.pp_size: 1f1b with pp_size 8 runs 8 stages \(1 per rank\), more than model\.num_layers \(4\)"),
        ([*PP2, "model.num_layers=3", "parallel.pp_schedule=zbv"],
         r"^parallel\.pp_schedule: zbv with pp_size 2 runs 4 stages \(2 per rank\), more than model\.num_layers"),
        ([*PP2, "train.micro_batch_size=4", "train.global_batch_size=4"],
         r"^parallel\.pp_schedule: 1f1b needs at least pp_size \(2\) micro-batches per step, the train "
         r"accumulation .* is 1"),
        ([*PP2, "train.global_batch_size=10", "parallel.pp_schedule=interleaved_1f1b"],
         r"^parallel\.pp_schedule: interleaved_1f1b runs the micro-batches in accumulation // pp_size rounds \(2\)"),
        ([*PP2, "parallel.strategy=deepspeed_zero2"],
         r"^parallel\.pp_size: runs on an FSDP2 device mesh; allowed with parallel\.strategy auto, fsdp, "
         r"fsdp_grad_op, not deepspeed_zero2$"),
        ([*PP2, "parallel.strategy=ddp"], r"^parallel\.pp_size: runs on an FSDP2 device mesh"),
        ([*PP2, "parallel.pp_split=[3,1]"], r"^parallel\.pp_split: needs 1 layer indices"),
        ([*PP2, "parallel.pp_split=[4]"], r"^parallel\.pp_split: must be increasing layer indices between 1 and 3"),
        ([*PP2, "parallel.pp_split=[0]"], r"^parallel\.pp_split: "),
        ([*LLAMA4, "parallel.pp_split=[2]"], r"^parallel\.pp_split: splits the model into pipeline stages"),
        ([*PP2, "parallel.pp_schedule=zb"], r"^parallel\.pp_schedule: got 'zb'; allowed: gpipe, 1f1b, "),
        ([*PP2, "model.name=shakespeare-char", "model.num_layers=4"], r"^parallel\.pp_size: .*tied embedding and head"),
        ([*PP2, "train.compile=true", "train.compile_mode=reduce-overhead"],
         r"^train\.compile_mode: reduce-overhead captures CUDA graphs, which a pipeline's sends and receives"),
        ([*PP2, "train.compile=true", "train.compile_mode=max-autotune"], r"^train\.compile_mode: max-autotune "),
    ],
)  # fmt: skip
def test_bad_pipeline_layouts_are_one_line_naming_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_run_config(overrides=overrides)


def test_pipelines_and_tensor_parallel_groups_read_one_batch() -> None:
    cfg = build_run_config([*LLAMA4, "parallel.nproc_per_node=8", "parallel.pp_size=2", "parallel.tp_size=2"])
    batch, plan = cfg.batch_plan(), cfg.parallel_plan()
    # 8 ranks = pipeline 2 × data parallel 2 × tensor parallel 2: the accumulation is the pipeline's micro-batches
    assert (batch.data_parallel_size, batch.accumulation) == (2, 2)
    assert (plan.strategy, plan.pp_size, plan.data_parallel_size, plan.dp_shard) == ("fsdp", 2, 2, 2)
    # pipeline outermost: ranks 0-3 are stage 0, 4-7 stage 1; each stage's data-parallel ranks are (0, 0, 1, 1)
    assert [data_parallel_rank(r, 2, 2) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert ParallelPlan.build(world_size=4, pp_size=2).strategy == "fsdp"


def test_an_unset_micro_batch_is_one_sequence_under_a_pipeline() -> None:
    """`train.micro_batch_size` null: the whole per-rank batch without a pipeline, 1 with one (torchtitan's
    default), so `--parallel.pp_size 2` trains with the default global batch instead of being refused for having
    one micro-batch; a micro-batch the user sets is kept."""
    default = ["model.name=llama-tiny", "model.num_layers=4", "parallel.nproc_per_node=2"]
    flat = build_run_config([*default, "parallel.strategy=fsdp"]).batch_plan()
    assert (flat.micro_batch_size, flat.accumulation, flat.data_parallel_size) == (6, 1, 2)
    piped = build_run_config([*default, "parallel.pp_size=2"]).batch_plan()
    assert (piped.micro_batch_size, piped.accumulation, piped.data_parallel_size) == (1, 12, 1)
    both = build_run_config([*default, "parallel.nproc_per_node=4", "parallel.pp_size=2"]).batch_plan()
    assert (both.micro_batch_size, both.accumulation, both.data_parallel_size) == (1, 6, 2)
    assert (
        build_run_config([*default, "parallel.pp_size=2", "train.micro_batch_size=3"])
        .batch_plan()
        .accumulation
        == 4
    )


def test_stages_split_layers_evenly_or_where_told_and_sit_in_a_loop_or_a_v() -> None:
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(4, 2, [1]) == [range(0, 1), range(1, 4)]
    assert stage_layers(4, 4) == [range(k, k + 1) for k in range(4)]
    assert [local_stages("1f1b", 2, r) for r in range(2)] == [[0], [1]]
    assert [local_stages("interleaved_1f1b", 2, r) for r in range(2)] == [[0, 2], [1, 3]]
    assert [local_stages("zbv", 2, r) for r in range(2)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["parallel.nproc_per_node=4", "parallel.pp_size=3"], ("parallel.pp_size:", "must divide world_size")),
        (["model.num_layers=3"], ("parallel.pp_size:", "multiple of the 2 pipeline stages")),
        (["parallel.pp_schedule=interleaved_1f1b", "model.num_layers=3"], ("parallel.pp_schedule:", "4 stages")),
        (["train.global_batch_size=2"], ("parallel.pp_schedule:", "1f1b needs at least pp_size (2) micro-batches")),
        (["parallel.strategy=deepspeed_zero3"], ("parallel.pp_size:", "auto, fsdp, fsdp_grad_op")),
        (["parallel.pp_split=[3,1]"], ("parallel.pp_split:", "needs 1 layer indices")),
        (["parallel.pp_split=[9]"], ("parallel.pp_split:", "between 1 and 3")),
    ],
    ids=["world", "layers", "interleaved-layers", "micro-batches", "deepspeed", "split-count", "split-range"],
)  # fmt: skip
def test_gaudi3_train_refuses_with_one_line_exit_2_and_writes_nothing(
    overrides: list[str], words: tuple[str, ...], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gaudi3_scale.cli.main import main

    out = tmp_path / "run"
    argv = ["train", "--out", str(out), *(f"--{item}" for item in [*PP2, *overrides])]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("gaudi3: error: ") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_bad_layout_is_refused_by_the_real_command(tmp_path) -> None:
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out),
           *(f"--{item}" for item in [*PP2, "parallel.strategy=ddp"])]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "gaudi3: error: parallel.pp_size: runs on an FSDP2 device mesh; allowed with parallel.strategy auto, fsdp, "
        "fsdp_grad_op, not ddp"
    ]
    assert list(tmp_path.iterdir()) == []
