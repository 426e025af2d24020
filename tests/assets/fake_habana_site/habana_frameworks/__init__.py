"""A stand-in for Habana's package, for tests only: it reports 8 HPUs and nothing more, so that Trainer
construction with accelerator="hpu" can be checked on a machine without Gaudi. It runs no kernel; training on it
is impossible by design."""
