"""What a running job costs, below the trainer: the instance price catalog (`catalog`, data in `instances.yaml`),
the `cost` section of a run config (`config`), live cost accrual with budgets (`live`) and spot prices with the
pause / scale-up policy (`spot`).

`gaudi3_scale.cost` (a tool: estimates and reports) and the trainer's `LiveCost` callback import from here. No torch
import anywhere in this package."""
