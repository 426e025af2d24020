"""Lightning glue: a DataModule whose checkpointed state is the position in the sample stream.

Lightning saves ``datamodule.state_dict()`` in every checkpoint and calls ``load_state_dict`` on
``fit(ckpt_path=...)`` (after ``setup``, before ``train_dataloader``). The state is ``samples_consumed =
global_step * global_batch_size``; since a step's samples do not depend on world size (see `sampler`), a run can
resume on a different number of ranks and read the exact batches it would have read.

Ranks here are data-parallel ranks: the `tp_size` ranks of one tensor-parallel group, and the stages of one
pipeline, read the same batches (`distributed.mesh.data_parallel_coordinate`), so a run resumes across layouts
(TP=2 → one process, FSDP×TP → FSDP) on the same stream too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data.dataset import PreparedData
from gaudi3_scale.data.inputs import DatasetMember, TrainingData, require_block_room, training_data_from_dir
from gaudi3_scale.data.loader import Batch, TokenWindowDataset, ValWindowDataset
from gaudi3_scale.data.mixture import MixtureSampler
from gaudi3_scale.data.mlm import MlmMasking
from gaudi3_scale.data.sampler import WindowSampler, whole_block
from gaudi3_scale.data.skips import BatchSkips
from gaudi3_scale.distributed.mesh import data_parallel_coordinate

__all__ = ["SKIPPED_KEY", "TokenDataModule"]

# in the datamodule's state: the data steps below samples_consumed's that made no update (skipped, or the step
# guard dropped their update)
SKIPPED_KEY = "skipped_data_steps"


class TokenDataModule(pl.LightningDataModule):
    def __init__(
        self,
        data: TrainingData | PreparedData | Path | str,
        *,
        context_length: int,
        global_batch_size: int,
        micro_batch_size: int,
        seed: int,
        val_batches: int,
        loader_workers: int = 0,
        stride: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        prefetch_shards: int = 0,
        masking: MlmMasking | None = None,
        skips: BatchSkips | None = None,
        allow_data_change: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(data, PreparedData):
            data = data.directory
        self._data = data if isinstance(data, TrainingData) else None
        self._directory = None if isinstance(data, TrainingData) else Path(data)
        self.context_length = context_length
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.val_batches = val_batches
        self.loader_workers = loader_workers
        self.stride = stride
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.prefetch_shards = prefetch_shards
        self.masking = masking  # arch bert: batches are (masked inputs, labels), data.mlm
        self.skips = skips or BatchSkips()  # batches that make no update (health)
        # train.allow_data_change: a resume continues on changed data at the checkpoint's data step (`sampler`)
        self.allow_data_change = allow_data_change
        self.start_step = 0  # data step the next train_dataloader() starts at
        # A resume: the checkpoint's sampler state, until the loader counts from it; then (its data step, the
        # batches its stream skipped below that step)
        self._resumed: dict[str, Any] | None = None
        self._skipped_before: tuple[int, list[int]] | None = None
        self.sampler: WindowSampler | MixtureSampler | None = None
        self._pending_state: dict[str, Any] | None = None

    @property
    def has_data(self) -> bool:
        return self._data is not None

    @property
    def data(self) -> TrainingData:
        if self._data is None:
            assert self._directory is not None
            self._data = TrainingData(members=[training_data_from_dir(self._directory)])
        return self._data

    def _world(self) -> tuple[int, int]:
        """(data-parallel ranks, this rank's data-parallel coordinate)."""
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return data_parallel_coordinate(trainer.world_size, trainer.global_rank, self.tp_size, self.pp_size)

    def _member_sampler(self, member: DatasetMember, world_size: int, rank: int) -> WindowSampler:
        return WindowSampler(
            member.train.shard_tokens,
            self.context_length,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            world_size=world_size,
            rank=rank,
            seed=self.seed,
            stride=self.stride,
            block_shards=member.block_shards,
            allow_data_change=self.allow_data_change,
        )

    def _mixture_member_sampler(self, member: DatasetMember) -> WindowSampler:
        try:
            return self._member_sampler(member, 1, 0)
        except UserInputError as e:  # e.g. too few tokens for one window: say which member
            raise UserInputError(f"data.mixture member {member.name!r}: {e}") from None

    def build_sampler(self, world_size: int, rank: int) -> WindowSampler | MixtureSampler:
        data = self.data
        if not data.is_mixture:
            return self._member_sampler(data.members[0], world_size, rank)
        return MixtureSampler(
            [self._mixture_member_sampler(m) for m in data.members],
            [m.weight for m in data.members],
            [m.name for m in data.members],
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            world_size=world_size,
            rank=rank,
        )

    def setup(self, stage: str | None = None) -> None:
        world_size, rank = self._world()
        self.sampler = self.build_sampler(world_size, rank)
        trainer = self.trainer
        module = trainer.lightning_module if trainer is not None else None
        # With automatic optimization Lightning steps the optimizer every accumulate_grad_batches micro-batches,
        # which must be the sampler's global batch. A manually optimized module accumulates by itself.
        automatic = module is not None and module.automatic_optimization
        if automatic and trainer is not None and trainer.accumulate_grad_batches != self.sampler.accum_steps:
            raise ConfigError(
                "accumulate_grad_batches",
                f"is {trainer.accumulate_grad_batches}, but global_batch_size {self.global_batch_size} / "
                f"(micro_batch_size {self.micro_batch_size} × world_size {world_size}) = {self.sampler.accum_steps}",
            )
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
            self._pending_state = None

    def _require_sampler(self) -> WindowSampler | MixtureSampler:
        if self.sampler is None:
            raise RuntimeError(
                "TokenDataModule.setup() must run before its dataloaders or state_dict are used"
            )
        return self.sampler

    @property
    def accum_steps(self) -> int:
        return self._require_sampler().accum_steps

    def train_dataloader(self) -> DataLoader[Batch]:
        self._count_from_checkpoint()
        dataset = TokenWindowDataset(
            [m.train for m in self.data.members],
            self._require_sampler(),
            start_step=self.start_step,
            prefetch_shards=self.prefetch_shards,
            masking=self.masking,
            skipped=self.skips.skipped,
        )
        return DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.loader_workers,
            generator=self._loader_generator(),
            pin_memory=self._pin_memory(),
        )

    def _pin_memory(self) -> bool:
        """Batches in page-locked memory when training on CUDA: Lightning copies them to the device with
        `non_blocking=True`, which overlaps the copy with compute only from pinned memory (torch's caching host
        allocator reuses the pinned blocks, so pinning costs no allocation per step)."""
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def val_dataloader(self) -> DataLoader[Batch]:
        world_size, rank = self._world()
        dataset = ValWindowDataset(
            [m.val for m in self.data.members],
            self.context_length,
            micro_batch_size=self.micro_batch_size,
            max_batches=self.val_batches,
            world_size=world_size,
            rank=rank,
            weights=[m.weight for m in self.data.members],
            masking=self.masking,
        )
        # No worker processes: the validation set is a handful of batches and workers would restart every epoch.
        return DataLoader(
            dataset, batch_size=None, shuffle=False, num_workers=0, generator=self._loader_generator()
        )

    def _loader_generator(self) -> torch.Generator:
        """A private generator for the DataLoader's per-iterator base seed.

        Without one, every new iterator draws that seed from the global torch RNG, so a resumed run (which builds
        its iterator after the checkpoint's RNG state was restored) would end up one draw ahead of a run that
        never stopped. Our datasets are deterministic by step, so the base seed only names worker seeds.
        """
        return torch.Generator().manual_seed(self.seed)

    def state_dict(self) -> dict[str, Any]:
        sampler = self._require_sampler()
        # trainer.global_step counts optimizer updates; the stream also passed the batches that made none.
        step = (
            self.skips.next_data_step(self.trainer.global_step)
            if self.trainer is not None
            else self.start_step
        )
        state = sampler.state_dict(samples_consumed=step * self.global_batch_size)
        # what made no update below that position: a resume refuses a skip listed there that is none of these
        first, before = self._skipped_before or (0, [])
        no_update = sorted({*self.skips.skipped, *self.skips.dropped})
        state[SKIPPED_KEY] = [*before, *(s for s in no_update if first <= s < step)]
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if self.sampler is None:  # restored before setup(): validated there, against the real dataset
            self._pending_state = dict(state_dict)
        else:
            if self._adopt_blocks(state_dict):
                self.sampler = self.build_sampler(*self._world())
            self.start_step = self.sampler.start_step_from_state(state_dict)
            self._resumed = dict(state_dict)

    def _count_from_checkpoint(self) -> None:
        """A resumed stream counts from the checkpoint's data step (`BatchSkips.resume_at`), once Lightning has
        restored the update count and the step guard its dropped batches. A `health.skip_batches` entry below that
        step which the checkpoint's run neither skipped nor dropped the update of is refused: that batch is trained
        on already, and skipping cannot take it back."""
        state, self._resumed = self._resumed, None
        if state is None or self.trainer is None:
            return
        start, skips = self.start_step, self.skips
        loads = self.trainer.global_step + len(skips.dropped)
        dropped = set(skips.dropped)  # loaded, but made no update: listing one takes nothing back
        below = [s for s in skips.skipped if s < start and s not in dropped]
        recorded = state.get(SKIPPED_KEY)
        if isinstance(recorded, list):  # written since the record: name the new ones exactly
            before = sorted({s for s in recorded if isinstance(s, int) and s < start})
            trained = sorted(set(below) - set(before))
        else:  # an older checkpoint: its position says how many it skipped below it
            before, trained = below, below if len(below) > start - loads else []
        if trained:
            raise ConfigError(
                "health.skip_batches",
                f"{_batches(trained)} trained on before data step {start}, where the checkpoint resumes (a skip "
                f"cannot take that back); list only batches from {start} on, or, to leave them out, resume from a "
                "checkpoint before them (train.resume) or start over in a new --out directory",
            )
        skips.resume_at(loads=loads, data_step=start)
        self._skipped_before = (start, before)

    def _adopt_blocks(self, state: Mapping[str, Any]) -> bool:
        """A member whose `data.shuffle_block_shards` was left null resumes with the checkpoint's block size (the
        stream depends on it; a URL dataset's default follows the cache size, which may have changed, so the cache
        must hold that block: `require_block_room`). Under `train.allow_data_change` a local member whose
        checkpoint block was all of its shards then keeps its default, all of them now (`sampler.whole_block`)."""
        members = self.data.members
        saved = [m.get("sampler", {}) for m in state.get("members", [])] if len(members) > 1 else [state]
        changed = False
        for member, member_state in zip(members, saved, strict=False):
            block = member_state.get("block_shards") if isinstance(member_state, Mapping) else None
            if (
                self.allow_data_change
                and member.url is None
                and isinstance(member_state, Mapping)
                and whole_block(member_state, member.block_shards)
            ):
                continue
            if member.block_auto and isinstance(block, int) and block > 0 and block != member.block_shards:
                block = min(block, len(member.train.shard_tokens))  # data changed (train.allow_data_change)
                require_block_room(member, block)
                member.block_shards, changed = block, True
        return changed


def _batches(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:5]) + (", …" if len(steps) > 5 else "")
    return f"batch {shown} was" if len(steps) == 1 else f"batches {shown} were"
