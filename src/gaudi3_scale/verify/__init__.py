"""Tools that check the stack: `smoke` (one short run per stage: train, resume, sample), `repro` (the same run twice,
or across modes, compared metric by metric and checkpoint tensor by tensor), and `doctor` (what a node needs before a
training run: accelerator, network, limits, disk, clock, versions, endpoints; no training)."""
