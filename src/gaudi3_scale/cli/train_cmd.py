"""`gaudi3 train`: fit, then show a sample of what the model learned."""

from __future__ import annotations

import click

from gaudi3_scale.train.config import RunConfig

__all__ = ["run_training"]


def run_training(cfg: RunConfig, *, sample_tokens: int, progress: bool) -> None:
    from gaudi3_scale.train import GaudiTrainer
    from gaudi3_scale.train.inference import generate_text, load_for_generation

    trainer = GaudiTrainer(cfg, progress=progress)
    summary = trainer.fit()
    click.echo(
        f"outputs: {trainer.out_dir}/ (config.yaml, metrics.jsonl, summary.json, loss.png, checkpoints/)"
    )
    if sample_tokens > 0 and summary.get("checkpoint"):
        model, tokenizer = load_for_generation(summary["checkpoint"])
        click.echo("---- sample ----")
        click.echo(generate_text(model, tokenizer, "", max_new_tokens=sample_tokens, seed=cfg.seed))
