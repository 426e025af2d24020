"""Foresight: what a run will take — per-rank peak memory, step time, tokens/s, wall time, energy and cost —
predicted from the run config, the machine (measured into a per-machine calibration store, or the catalog) and,
with a probe, a short real run of the same layout; then held against the run's own measurements
(`gaudi3 plan`, docs/foresight.md)."""
