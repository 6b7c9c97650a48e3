"""In-memory image datasets for the built-in demo: data-parallel sharded, with an exact position.

The sample order of epoch ``e`` is a permutation seeded by ``(seed, e)``; the loader's whole state
is the number of global batches consumed, so resuming replays exactly the same batches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ImageBatch:
    """A dense micro-batch: images ``[b, C, H, W]`` in [-1, 1] and class labels ``[b]``."""

    images: torch.Tensor
    labels: torch.Tensor


class InMemoryImageLoader:
    """Yields micro-batches for one data-parallel rank; every rank sees a disjoint slice of each
    global batch, and a global batch never straddles an epoch boundary (the tail is dropped)."""

    per_rank_state = False  # the position is the same on every rank: it lives in the common state

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, global_batch_size: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, seed: int):
        if global_batch_size > len(images):
            raise ValueError(f"data.global_batch_size ({global_batch_size}) exceeds the dataset size "
                             f"({len(images)}); lower it")
        self.images, self.labels = images, labels
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.batches_per_epoch = len(images) // global_batch_size
        self.consumed_batches = 0

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.images), generator=g)

    def next_global_batch(self) -> list[ImageBatch]:
        """This rank's micro-batches of the next global batch."""
        epoch, index = divmod(self.consumed_batches, self.batches_per_epoch)
        order = self._order(epoch)[index * self.global_batch_size:(index + 1) * self.global_batch_size]
        per_rank = self.global_batch_size // self.dp_size
        mine = order[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        self.consumed_batches += 1
        return [ImageBatch(self.images[idx], self.labels[idx]) for idx in mine.split(self.micro_batch_size)]

    def state_dict(self) -> dict:
        return {"consumed_batches": self.consumed_batches, "dp_size": self.dp_size,
                "global_batch_size": self.global_batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for key in ("global_batch_size", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(f"checkpoint was written with data {key}={state[key]} but this run uses "
                                 f"{getattr(self, key)}; resume with the same value")
        self.consumed_batches = state["consumed_batches"]


def builtin_dataset(name: str, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "digits":
        from energon_data.datasets import load_digits
        return load_digits(size=image_size)
    raise ValueError(f"unknown built-in dataset data.name={name!r}; use 'digits' or set data.path "
                     "to a prepared energon dataset")
