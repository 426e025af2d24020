"""The memory estimate under train.compile and fp8, against the H200 measurements stored by
benchmarks/bench_gpu_shapes.py (re-forecast here with the code as it is), and the fp8 plan's terms."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gaudi3_scale.device.float8 import Float8Plan
from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.models import get_model_config
from gaudi3_scale.tune.memory import MemoryEstimate, estimate_memory

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "benchmarks" / "results" / "gpu_shapes_cuda_h200.json"
LLAMA_1B = get_model_config("llama3.2-1b")
BATCH = BatchPlan.from_micro_batch(8, context_length=2048)
EAGER, COMPILED = ParallelPlan(), ParallelPlan(compile=True)


def _measured() -> dict[str, dict]:
    rows = json.loads(H200.read_text())["shapes"]
    return {name: row for name, row in rows.items() if row["run"].get("status") == "ok"}


@pytest.mark.parametrize("name", [n for n, r in _measured().items() if r["cell"]["compile"]])
def test_compiled_shapes_within_2_percent_of_the_h200(name: str) -> None:
    """Every compiled shape measured on the H200 (max_memory_allocated), re-forecast by the code as it is."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_gpu import Cell
    from bench_gpu_shapes import forecast

    row = _measured()[name]
    predicted = forecast(Cell(**row["cell"]), "cuda", None)["memory_bytes"]
    measured = row["run"]["peak_memory_bytes"]
    assert predicted == pytest.approx(measured, rel=0.02), (predicted / measured - 1, name)


def test_the_stored_h200_run_has_the_shapes_the_claims_rest_on() -> None:
    measured = _measured()
    assert {"llama3.2-1b-bf16", "llama3.2-1b-fp8-head", "llama3.2-3b-bf16", "gpt2-mb32-compiled",
            "bert-base-mb32"} <= set(measured)  # fmt: skip
    machine = json.loads(H200.read_text())["machine"]
    assert machine["cuda"]["device"] == "NVIDIA H200" and machine["packages"]["torch"] == "2.11.0"


def test_compile_shrinks_activations_and_the_loss() -> None:
    eager = estimate_memory(LLAMA_1B, EAGER, BATCH, precision="bf16-mixed", device_kind="cuda")
    compiled = estimate_memory(LLAMA_1B, COMPILED, BATCH, precision="bf16-mixed", device_kind="cuda")
    assert compiled.compiled and not eager.compiled
    assert compiled.params_bytes == eager.params_bytes and compiled.optimizer_bytes == eager.optimizer_bytes
    assert compiled.activations_bytes < 0.7 * eager.activations_bytes
    # compiled: the bf16 logits and the head's fresh fp32 gradient; eager: three fp32 b·s·V tensors
    b_s_v, v_h = 8 * 2048 * LLAMA_1B.padded_vocab_size, LLAMA_1B.padded_vocab_size * LLAMA_1B.dim
    assert compiled.workspace_bytes == 2 * b_s_v + 4 * v_h
    assert eager.workspace_bytes == 3 * 4 * b_s_v


def test_fp8_plan_terms() -> None:
    def est(float8: Float8Plan) -> MemoryEstimate:
        plan = ParallelPlan(compile=True, float8=float8)
        return estimate_memory(LLAMA_1B, plan, BATCH, precision="fp8", device_kind="cuda")

    bf16 = estimate_memory(LLAMA_1B, COMPILED, BATCH, precision="bf16-mixed", device_kind="cuda")
    tensorwise = est(float8=Float8Plan(recipe="tensorwise", head=False, skip_small_linears=False))
    head = est(float8=Float8Plan(recipe="tensorwise", head=True, skip_small_linears=False))
    gw_hp = est(float8=Float8Plan(recipe="rowwise_with_gw_hp", head=True, skip_small_linears=False))
    # No bf16 cast copies of the converted weights: the head's only while it stays in bf16.
    head_copy = 2 * LLAMA_1B.padded_vocab_size * LLAMA_1B.dim
    assert (
        tensorwise.params_bytes == bf16.params_bytes - (bf16.params_bytes - 4 * bf16.parameters) + head_copy
    )
    assert head.params_bytes == 4 * bf16.parameters
    # fp8 inputs of the converted linears: per block and token, −2h for the norms' outputs, −f for the MLP
    # product, +h for the attention output's second (fp8) copy
    tokens, h, f = 8 * 2048, LLAMA_1B.dim, LLAMA_1B.hidden_dim
    assert bf16.activations_bytes - tensorwise.activations_bytes == LLAMA_1B.num_layers * tokens * (h + f)
    # rowwise_with_gw_hp computes the weight gradient in high precision: bf16 inputs, as bf16-mixed
    assert gw_hp.activations_bytes == bf16.activations_bytes
    # Eager fp8 keeps torchao's high-precision inputs: only the weight copies go.
    eager = estimate_memory(LLAMA_1B, EAGER, BATCH, precision="fp8", device_kind="cuda")
    eager_bf16 = estimate_memory(LLAMA_1B, EAGER, BATCH, precision="bf16-mixed", device_kind="cuda")
    assert eager.activations_bytes == eager_bf16.activations_bytes
    assert eager.params_bytes < eager_bf16.params_bytes


def test_compiled_checkpointing_keeps_block_inputs_and_one_block() -> None:
    deep, shallow = replace(LLAMA_1B, num_layers=16), replace(LLAMA_1B, num_layers=8)
    plan = ParallelPlan(compile=True, activation_checkpointing=True)
    kw = {"precision": "bf16-mixed", "device_kind": "cuda"}
    per_layer = (
        estimate_memory(deep, plan, BATCH, **kw).activations_bytes
        - estimate_memory(shallow, plan, BATCH, **kw).activations_bytes
    )
    assert per_layer == 8 * (8 * 2048 * LLAMA_1B.dim * 4)  # each block's fp32 input
