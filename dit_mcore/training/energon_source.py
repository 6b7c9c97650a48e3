"""Training batches from a prepared energon dataset: packed THD micro-batches per data-parallel rank.

Wraps ``energon_data.loader``: the loader is built for the *data-parallel* rank (TP/CP/PP ranks of
one replica read the same batches), and its state travels in every checkpoint, per rank.
"""
from __future__ import annotations

import logging

from energon_data.loader import DataConfig as EnergonDataConfig
from energon_data.loader import DataResumeError, build_train_loader, restore_state, save_state

log = logging.getLogger(__name__)


class EnergonSource:
    """``next_global_batch()`` returns this rank's micro-batches (``LatentBatch``) of one step."""

    per_rank_state = True

    def __init__(self, data, model_config, parallel, *, dp_rank: int, dp_size: int, seed: int,
                 num_microbatches: int):
        pad_multiple = 1
        if parallel.context_parallel_size > 1 or parallel.sequence_parallel:
            pad_multiple = 2 * parallel.context_parallel_size * parallel.tensor_model_parallel_size
        self.config = EnergonDataConfig(
            path=data.path, patch_size=(model_config.patch_size_t, model_config.patch_size, model_config.patch_size),
            max_seq_len=data.max_seq_len, pad_multiple=pad_multiple, micro_batch_size=data.micro_batch(dp_size),
            num_workers=data.num_workers, packing_buffer_size=data.packing_buffer_size,
            shuffle_buffer_size=data.shuffle_buffer_size, restart_data_on_mismatch=data.restart_data_on_mismatch)
        self.num_microbatches = num_microbatches
        self.loader = build_train_loader(self.config, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        self._iter = None

    def next_global_batch(self) -> list:
        if self._iter is None:
            self._iter = iter(self.loader)
        return [next(self._iter) for _ in range(self.num_microbatches)]

    def layout(self) -> dict:
        """What must match for an exact restore (checked before loading any per-rank state)."""
        wc = self.loader.worker_config
        return {"dp_size": wc.world_size, "num_workers": wc.num_workers}

    def state_dict(self) -> dict:
        return save_state(self.loader, self.config)

    def load_state_dict(self, state) -> bool:
        return restore_state(self.loader, state, self.config)

    def check_layout(self, saved: dict, world_size: int, saved_world_size: int) -> bool:
        """True if per-rank states can be loaded; False if they must be dropped (restart opted in)."""
        problems = [f"data.{k} (data-parallel size)" if k == "dp_size" else f"data.{k}"
                    for k in saved if saved[k] != self.layout()[k]]
        if saved_world_size != world_size:
            problems.append("world size")
        if not problems:
            return True
        msg = (f"cannot resume the data loader exactly: {', '.join(problems)} changed since the checkpoint "
               f"(saved {saved}, world size {saved_world_size}; now {self.layout()}, world size {world_size}); "
               "energon restores per rank and per worker")
        if not self.config.restart_data_on_mismatch:
            raise DataResumeError(msg + ". Keep them, or set data.restart_data_on_mismatch=True to restart "
                                        "the data stream")
        log.warning("%s; restarting the data stream (data.restart_data_on_mismatch)", msg)
        return False
