"""Autotuning: the analytic memory estimate (`tune.memory`), the search space, trials and the tuner.

Nothing is imported here: `gaudi3 tune --estimate-only` needs only the estimator, not Lightning or the trial runner.
"""
