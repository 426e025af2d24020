"""A real (tiny) Lightning run: the DataModule's sampler state rides in the checkpoint and resume is exact."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.data import DataConfig, PreparedData, TokenDataModule, load_prepared, prepare_dataset

pytestmark = [
    pytest.mark.integration,
    # Expected and harmless here: the dataloader is resumed by the DataModule, not by Lightning's loop state.
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),  # inside Lightning
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),  # the resumed run's
]

T, MICRO, GLOBAL = 16, 4, 8  # accumulate 2 micro-batches per optimizer step on 1 device


class TinyLM(pl.LightningModule):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, vocab_size)
        self.train_inputs: list[torch.Tensor] = []
        self.val_inputs: list[torch.Tensor] = []

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.head(self.embed(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.train_inputs.append(batch[0].clone())
        return self._loss(batch)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_inputs.append(batch[0].clone())
        self.log("val/loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    return load_prepared(prepare_dataset(DataConfig(), tmp_path_factory.mktemp("ds"), progress=False))


def datamodule(data: PreparedData) -> TokenDataModule:
    return TokenDataModule(
        data, context_length=T, global_batch_size=GLOBAL, micro_batch_size=MICRO, seed=5, val_batches=2
    )


def trainer(root: Path, max_steps: int, accumulate: int = 2, **kw: object) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=6,  # micro-batches; the train stream is infinite, so no epoch end
        **kw,  # type: ignore[arg-type]
    )


def test_resume_sees_exactly_the_batches_of_an_uninterrupted_run(data: PreparedData, tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    full = TinyLM(data.vocab_size)
    trainer(tmp_path, 6, callbacks=[ckpt]).fit(full, datamodule=datamodule(data))
    assert len(full.train_inputs) == 12  # 6 optimizer steps x 2 micro-batches

    step3 = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    saved = torch.load(step3, weights_only=False)["TokenDataModule"]
    assert saved["samples_consumed"] == 3 * GLOBAL

    resumed = TinyLM(data.vocab_size)
    dm = datamodule(data)
    ckpt_again = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp_path / "resume", 6, callbacks=[ckpt_again]).fit(resumed, datamodule=dm, ckpt_path=step3)
    assert dm.start_step == 3
    assert len(resumed.train_inputs) == 6
    for a, b in zip(full.train_inputs[6:], resumed.train_inputs, strict=True):
        assert torch.equal(a, b)
    for p_full, p_resumed in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p_full, p_resumed)  # same batches, same updates: bitwise the same model

    # the micro-batches really are the sampler's windows, in (step, micro-step) order
    sampler = dm.sampler
    assert sampler is not None
    first = torch.from_numpy(data.train[sampler.micro_batch_starts(0, 0)].astype("int64"))
    assert torch.equal(full.train_inputs[0][:, 0], first)
    # validation ran on the fixed windows, both times the same two batches
    assert len(full.val_inputs) == 4 and torch.equal(full.val_inputs[0], full.val_inputs[2])


def test_mismatched_accumulation_is_refused(data: PreparedData, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"accumulate_grad_batches: is 1, but global_batch_size 8 / .* = 2"):
        trainer(tmp_path, 1, accumulate=1).fit(TinyLM(data.vocab_size), datamodule=datamodule(data))


class ManualTinyLM(TinyLM):
    """Accumulates by itself (as the stack's LanguageModel does), so Lightning's accumulate_grad_batches stays 1."""

    def __init__(self, vocab_size: int, accumulation: int) -> None:
        super().__init__(vocab_size)
        self.automatic_optimization = False
        self.accumulation = accumulation

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.train_inputs.append(batch[0].clone())
        loss = self._loss(batch)
        self.manual_backward(loss / self.accumulation)
        if (batch_idx + 1) % self.accumulation == 0:
            optimizer = self.optimizers()
            assert isinstance(optimizer, pl.core.optimizer.LightningOptimizer)
            optimizer.step()
            optimizer.zero_grad()
        return loss


def test_manual_optimization_reads_the_same_stream(data: PreparedData, tmp_path: Path) -> None:
    manual = ManualTinyLM(data.vocab_size, accumulation=2)
    dm = datamodule(data)
    trainer(tmp_path, 3, accumulate=1, limit_val_batches=0).fit(manual, datamodule=dm)
    assert dm.sampler is not None and dm.sampler.accum_steps == 2
    # manual optimization counts a global step per optimizer.step(): 3 steps = 6 micro-batches
    expected = [dm.sampler.micro_batch_starts(step, a) for step in range(3) for a in range(2)]
    assert len(manual.train_inputs) == 6
    for x, starts in zip(manual.train_inputs, expected, strict=True):
        assert x[:, 0].tolist() == data.train[starts].tolist()
    assert dm.state_dict()["samples_consumed"] == 3 * GLOBAL


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")  # the first fit's ModelCheckpoint
def test_allow_data_change_resumes_at_the_checkpoints_data_step_of_the_new_stream(tmp_path: Path) -> None:
    """train.allow_data_change: text cut after a checkpoint (other shards, other windows) resumes at the
    checkpoint's data step, in the new stream's order; without it the sampler state is refused, and with it a
    change to how windows are cut (the data seed) still is."""
    from gaudi3_scale.config.errors import UserInputError
    from gaudi3_scale.data.sources import bundled_corpora

    text = tmp_path / "corpus.txt"
    text.write_text(bundled_corpora()["tinyshakespeare"].read_text()[:12_000])
    before = load_prepared(prepare_dataset(DataConfig(source=str(text), tokenizer="byte"), tmp_path / "a",
                                           progress=False))  # fmt: skip
    text.write_text(text.read_text()[:6_000])
    after = load_prepared(prepare_dataset(DataConfig(source=str(text), tokenizer="byte"), tmp_path / "b",
                                          progress=False))  # fmt: skip
    assert before.vocab_size == after.vocab_size and len(after.train) < len(before.train)

    def changed(allow: bool, seed: int = 5) -> TokenDataModule:
        return TokenDataModule(after, context_length=T, global_batch_size=GLOBAL, micro_batch_size=MICRO,
                               seed=seed, val_batches=2, allow_data_change=allow)  # fmt: skip

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = TokenDataModule(before, context_length=T, global_batch_size=GLOBAL, micro_batch_size=MICRO, seed=5,
                            val_batches=2)  # fmt: skip
    trainer(tmp_path, 2, callbacks=[ckpt], limit_val_batches=0).fit(
        TinyLM(before.vocab_size), datamodule=first
    )
    step2 = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    with pytest.raises(UserInputError, match=r"^checkpoint data-sampler state: num_windows was \d+, now \d+"):
        trainer(tmp_path / "refused", 4).fit(
            TinyLM(before.vocab_size), datamodule=changed(False), ckpt_path=step2
        )
    with pytest.raises(UserInputError, match=r"^checkpoint data-sampler state: seed was 5, now 6"):
        trainer(tmp_path / "seed", 4).fit(
            TinyLM(before.vocab_size), datamodule=changed(True, 6), ckpt_path=step2
        )
    resumed, dm = TinyLM(before.vocab_size), changed(True)
    trainer(tmp_path / "resumed", 4, limit_val_batches=0).fit(resumed, datamodule=dm, ckpt_path=step2)
    assert dm.start_step == 2 and dm.sampler is not None
    expected = [dm.sampler.micro_batch_starts(step, a) for step in (2, 3) for a in range(2)]
    assert len(resumed.train_inputs) == 4
    for x, starts in zip(resumed.train_inputs, expected, strict=True):
        assert x[:, 0].tolist() == after.train[starts].tolist()
    assert dm.state_dict()["samples_consumed"] == 4 * GLOBAL


def test_allow_data_change_on_a_grown_local_dataset_shuffles_all_its_shards(tmp_path: Path) -> None:
    """A local dataset's default block is all its shards: one that grew from 1 shard to several resumes under
    train.allow_data_change with a block of all of them (a full shuffle), not the checkpoint's block of 1."""
    from gaudi3_scale.data.sources import bundled_corpora

    text, corpus = tmp_path / "corpus.txt", bundled_corpora()["tinyshakespeare"].read_text()
    prepared = []
    for name, size in (("small", 3_000), ("grown", 12_000)):
        text.write_text(corpus[:size])
        cfg = DataConfig(source=str(text), tokenizer="byte", shard_mb=0.003)
        prepared.append(load_prepared(prepare_dataset(cfg, tmp_path / name, progress=False)))
    small, grown = prepared

    def module(data: PreparedData, allow: bool) -> TokenDataModule:
        return TokenDataModule(data, context_length=T, global_batch_size=GLOBAL, micro_batch_size=MICRO, seed=5,
                               val_batches=1, allow_data_change=allow)  # fmt: skip

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = module(small, False)
    trainer(tmp_path, 2, callbacks=[ckpt], limit_val_batches=0).fit(
        TinyLM(small.vocab_size), datamodule=first
    )
    assert first.sampler is not None and first.sampler.block_shards == 1
    dm = module(grown, True)
    trainer(tmp_path / "resumed", 3, limit_val_batches=0).fit(
        TinyLM(small.vocab_size), datamodule=dm, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    )
    assert dm.sampler is not None and dm.start_step == 2
    assert dm.sampler.num_shards >= 3 and dm.sampler.block_shards == dm.sampler.num_shards
