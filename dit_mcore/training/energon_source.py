"""Training batches from prepared energon datasets: packed THD micro-batches per data-parallel rank.

Wraps ``energon_data.loader``: the loader is built for the *data-parallel* rank (TP/CP/PP ranks of
one replica read the same batches), and its state travels in every checkpoint, per rank.
"""
from __future__ import annotations

import dataclasses

from energon_data.batch import MicroBatch
from energon_data.config import DataConfig
from energon_data.loader import (accept_mismatch, build_train_loader, iterate_with_timeout, layout, layout_problems,
                                 restore_state, save_state)


class EnergonSource:
    """``next_global_batch()`` returns this rank's micro-batches (``MicroBatch``) of one step."""

    per_rank_state = True

    def __init__(self, data: DataConfig, model_config, *, pad_multiple: int, dp_rank: int, dp_size: int,
                 seed: int, num_microbatches: int):
        p = model_config.patch_size
        self.config = dataclasses.replace(data, patch_size=(model_config.patch_size_t, p, p),
                                          pad_multiple=pad_multiple, micro_batch_size=data.micro_batch(dp_size))
        self.num_microbatches = num_microbatches
        self.loader = build_train_loader(self.config, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        self._iter = None

    def next_global_batch(self) -> list[MicroBatch]:
        if self._iter is None:
            self._iter = iterate_with_timeout(self.loader, self.config)
        return [_micro_batch(next(self._iter)) for _ in range(self.num_microbatches)]

    def layout(self) -> dict:
        """What must match for an exact restore (checked before loading any per-rank state)."""
        return layout(self.loader)

    def state_dict(self) -> dict:
        return save_state(self.loader, self.config)

    def load_state_dict(self, state) -> bool:
        return restore_state(self.loader, state, self.config)

    def check_layout(self, saved: dict, world_size: int, saved_world_size: int) -> bool:
        """True if per-rank states can be loaded; False if they must be dropped (restart opted in)."""
        problems = layout_problems(saved, self.loader)
        if saved_world_size != world_size:
            problems.append(f"world size was {saved_world_size} in the checkpoint but is {world_size} now")
        return accept_mismatch(problems, self.config)


def _micro_batch(lb) -> MicroBatch:
    """The loader's ``LatentBatch`` (built in a worker, with its token maps) as the run's batch type."""
    return MicroBatch.packed(lb.tokens, lb.cu_seqlens, lb.grids, lb.labels, lb.cu_seqlens_padded,
                             token_to_sample=lb.sample_ids, positions=lb.positions, text_emb=lb.text_emb,
                             cu_seqlens_text=lb.cu_seqlens_text, num_skipped=lb.num_skipped)
