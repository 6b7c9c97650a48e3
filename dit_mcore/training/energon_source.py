"""Training batches from prepared energon datasets: packed THD micro-batches per data-parallel rank.

Wraps ``energon_data.loader``. By default every rank reads the one sample stream a single process would read
and keeps the micro-batches of each global batch that are its own (data-parallel rank ``r`` of ``D``, ``M``
micro-batches each: ``r*M .. r*M+M-1``, the places the trainer's noise is keyed by), so any layout trains on the
same global batches; the loader state is the same on every rank and travels once in each checkpoint, which
resumes on any number of ranks. With ``data.shard_over_ranks`` the loader is built for the data-parallel rank
(energon reads disjoint shares) and its state travels per rank. TP/CP/PP ranks of one replica read the same
batches either way.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Optional

from energon_data.batch import MicroBatch
from energon_data.config import DataConfig
from energon_data.loader import (accept_mismatch, build_train_loader, build_val_loader, iterate_with_timeout, layout,
                                 layout_problems, restore_state, save_state)

log = logging.getLogger(__name__)


class EnergonSource:
    """``next_global_batch()`` returns this rank's micro-batches (``MicroBatch``) of one step."""

    def __init__(self, data: DataConfig, model_config, *, pad_multiple: int, dp_rank: int, dp_size: int,
                 seed: int, num_microbatches: int):
        p = model_config.patch_size
        self.config = dataclasses.replace(data, patch_size=(model_config.patch_size_t, p, p),
                                          pad_multiple=pad_multiple, micro_batch_size=data.micro_batch(dp_size))
        self.per_rank_state = data.shard_over_ranks
        if data.shard_over_ranks:  # this rank's share of the stream, all of it kept
            self.read, self.keep = num_microbatches, slice(None)
            self.loader = build_train_loader(self.config, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        else:  # the whole stream, this rank's micro-batches of each global batch kept
            self.read = num_microbatches * dp_size
            self.keep = slice(dp_rank * num_microbatches, (dp_rank + 1) * num_microbatches)
            self.loader = build_train_loader(self.config, dp_rank=0, dp_size=1, seed=seed)
            if dp_size > 1 and dp_rank == 0:
                log.info("each of the %d data-parallel ranks reads the whole sample stream and keeps its micro-batches "
                         "(the one-process batches under any layout); data.shard_over_ranks=True splits the reading "
                         "instead", dp_size)
        self._iter = None

    def next_global_batch(self) -> list[MicroBatch]:
        if self._iter is None:
            self._iter = iterate_with_timeout(self.loader, self.config)
        read = [next(self._iter) for _ in range(self.read)]
        return [_micro_batch(lb) for lb in read[self.keep]]

    def layout(self) -> dict:
        """What must match for an exact restore (checked before loading any per-rank state)."""
        return layout(self.loader)

    def state_dict(self) -> dict:
        return save_state(self.loader, self.config)

    def load_state_dict(self, state: Optional[dict]) -> bool:
        """Restore the loader (True), or restart its stream (False: a mismatch, restart opted in). ``state``
        None with one state for every rank: the checkpoint holds per-rank states instead."""
        if state is None and not self.per_rank_state:
            accept_mismatch([_other_order(was=True)], self.config)  # (raises unless the restart is opted in)
            return False
        return restore_state(self.loader, state, self.config)

    def check_layout(self, saved: Optional[dict], world_size: int, saved_world_size: int) -> bool:
        """With per-rank states (``data.shard_over_ranks``): True if the checkpoint's can be loaded; False if
        they must be dropped (restart opted in). ``saved``: the checkpoint's ``layout()``, None when it holds
        one state for every rank."""
        if saved is None:
            problems = [_other_order(was=False)]
        else:
            problems = layout_problems(saved, self.loader)
            if saved_world_size != world_size:
                problems.append(f"world size was {saved_world_size} in the checkpoint but is {world_size} now")
        return accept_mismatch(problems, self.config)


def validation_batches(data: DataConfig, model_config, *, global_batches: int, per_global_batch: int,
                       micro_batch_size: int, pad_multiple: int) -> list[list[MicroBatch]]:
    """Up to ``global_batches`` global batches of ``per_global_batch`` micro-batches (one-process order) from
    one pass over the validation data (``data.val_path``, else the val split of ``data.path``), in energon's
    fixed validation order: what every rank reads alike, whatever the layout."""
    p = model_config.patch_size
    config = dataclasses.replace(data, patch_size=(model_config.patch_size_t, p, p), pad_multiple=pad_multiple,
                                 micro_batch_size=micro_batch_size)
    stream = iterate_with_timeout(build_val_loader(config, dp_rank=0, dp_size=1), config)
    read = [_micro_batch(lb) for lb in itertools.islice(stream, global_batches * per_global_batch)]
    del stream  # (its workers, if any, end with it)
    return [read[k:k + per_global_batch] for k in range(0, len(read) - per_global_batch + 1, per_global_batch)]


def _other_order(was: bool) -> str:
    return (f"the checkpoint was written with data.shard_over_ranks={was} (its loader state is "
            f"{'per rank' if was else 'one for every rank'}), this run has {not was}; set it back")


def _micro_batch(lb) -> MicroBatch:
    """The loader's ``LatentBatch`` (built in a worker, with its token maps) as the run's batch type."""
    return MicroBatch.packed(lb.tokens, lb.cu_seqlens, lb.grids, lb.labels, lb.cu_seqlens_padded,
                             token_to_sample=lb.sample_ids, positions=lb.positions, text_emb=lb.text_emb,
                             cu_seqlens_text=lb.cu_seqlens_text, num_skipped=lb.num_skipped)
