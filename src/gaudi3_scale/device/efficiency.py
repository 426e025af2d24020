"""What a run achieves of a device's peak (its MFU) when nothing better is known: our own measurement of that kind
of device where we have one, else an assumption said to be one. A probe of the run's layout (`gaudi3 plan
--probe`) or a benchmark result of the model (`cost compare --from-benchmarks`) replaces it."""

from __future__ import annotations

__all__ = ["ASSUMED_MFU", "fallback_mfu"]

# Llama 3.2 1B, bf16-mixed, compiled, micro-batch 8 × 2048 tokens, per accelerator we measured it on.
_MEASURED = {
    "h200-sxm": (0.5588, "measured: Llama 3.2 1B, bf16-mixed, compiled, micro-batch 8 × 2048 tokens on one H200 "
                 "(benchmarks/results/gpu_shapes_cuda_h200.json, 2026-11)"),
    "h100-sxm": (0.5283, "measured: Llama 3.2 1B, bf16-mixed, compiled, micro-batch 8 × 2048 tokens on one H100 "
                 "80GB HBM3 (benchmarks/results/gpu_cuda_h100_fp8.json, its bf16-mixed run, 2026-11-26)"),
}  # fmt: skip
ASSUMED_MFU = 0.40


def fallback_mfu(device_kind: str, accelerator: str | None = None) -> tuple[float, str]:
    """(MFU, where it comes from) for an accelerator (a catalog name) of a device kind (cpu, cuda, hpu): our
    measurement of that accelerator; for another CUDA device the H200's, said to be an assumption; else an
    unsourced assumption."""
    if accelerator in _MEASURED:
        return _MEASURED[accelerator]
    if device_kind == "cuda":
        value, source = _MEASURED["h200-sxm"]
        return value, f"assumption: no run of ours measured {accelerator or 'this GPU'}; as {source}"
    why = "not yet validated on Gaudi hardware" if device_kind == "hpu" else "no run of ours has measured it"
    return (
        ASSUMED_MFU,
        f"assumption: an unsourced fallback ({why}); a probe or a benchmark result replaces it",
    )
