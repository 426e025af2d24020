"""Tools that check the stack end to end by training: `smoke` (one short run per stage: train, resume, sample) and
`repro` (the same run twice, or across modes, compared metric by metric and checkpoint tensor by tensor)."""
