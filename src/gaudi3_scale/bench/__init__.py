"""Benchmark matrices: cells launched as training jobs, result JSON per cell, collection from logs, reports.

Nothing heavy is imported here; `gaudi3 benchmark collect` and `report` need neither torch nor Lightning.
"""
