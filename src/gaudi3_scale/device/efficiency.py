"""What a run achieves of a device's peak (its MFU) when nothing better is known: our own measurement of that kind
of device where we have one, else an assumption said to be one. A probe of the run's layout (`gaudi3 plan
--probe`) or a benchmark result of the model (`cost compare --from-benchmarks`) replaces it."""

from __future__ import annotations

__all__ = ["ASSUMED_MFU", "fallback_mfu"]

# Llama 3.2 1B, bf16-mixed, compiled, micro-batch 8 × 2048 tokens, on one H200 (the only kind we measured).
_MEASURED = {
    "cuda": (0.5588, "measured: Llama 3.2 1B, bf16-mixed, compiled, micro-batch 8 × 2048 tokens on one H200 "
             "(benchmarks/results/gpu_shapes_cuda_h200.json, 2026-11)"),
}  # fmt: skip
ASSUMED_MFU = 0.40


def fallback_mfu(device_kind: str) -> tuple[float, str]:
    """(MFU, where it comes from) for a device kind (cpu, cuda, hpu)."""
    if device_kind in _MEASURED:
        return _MEASURED[device_kind]
    why = "not yet validated on Gaudi hardware" if device_kind == "hpu" else "no run of ours has measured it"
    return (
        ASSUMED_MFU,
        f"assumption: an unsourced fallback ({why}); a probe or a benchmark result replaces it",
    )
