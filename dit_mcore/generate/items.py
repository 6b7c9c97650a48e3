"""What one generation call makes: a numbered list of items, each a label or a prompt and its noise.

An item's noise is drawn from a generator seeded by ``(seed, item index)`` alone, so the same
request gives the same pictures whatever the batch size, the number of ranks or the layout that
computes it. Ranks that share the items out (data parallel over items) take contiguous blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class Item:
    """One picture or clip to generate."""

    index: int
    """Its place in the request (file names and noise follow it)."""
    label: Optional[int] = None
    """The class label of a class-conditional model."""
    prompt: Optional[str] = None
    """The prompt of a text-conditioned model."""


def make_items(*, labels: Optional[Sequence[int]] = None, prompts: Optional[Sequence[str]] = None,
               num_per_prompt: int = 1, count: Optional[int] = None) -> list[Item]:
    """``num_per_prompt`` items per label or prompt, in the order given (label 0's items first); or
    ``count`` items with no condition (an unconditional model)."""
    if count is not None:
        if labels is not None or prompts is not None:
            raise ValueError("count is for unconditional items: give no labels or prompts with it")
        return [Item(index=i) for i in range(count)]
    if (labels is None) == (prompts is None):
        raise ValueError("give labels or prompts, not both and not neither")
    conditions = [dict(label=int(y)) for y in labels] if labels is not None else [dict(prompt=p) for p in prompts]
    return [Item(index=i * num_per_prompt + k, **c) for i, c in enumerate(conditions) for k in range(num_per_prompt)]


def item_seed(seed: int, index: int) -> int:
    """The noise seed of item ``index`` of a request made with ``seed``."""
    return (int(seed) * 1_000_003 + int(index)) % (2 ** 63)


def item_noise(items: Sequence[Item], seed: int, shape: Sequence[int], device=None) -> torch.Tensor:
    """Standard-normal noise ``[len(items), *shape]``, each row from its own item's generator (drawn on
    the host, so every device and layout gets the same values)."""
    rows = [torch.randn(tuple(shape), generator=torch.Generator().manual_seed(item_seed(seed, it.index)))
            for it in items]
    return torch.stack(rows).to(device)


def share(items: Sequence[Item], rank: int, size: int) -> list[Item]:
    """This rank's contiguous block of ``items`` when ``size`` ranks share them (the first ranks take one
    more when they do not divide)."""
    per, extra = divmod(len(items), size)
    start = rank * per + min(rank, extra)
    return list(items[start:start + per + (rank < extra)])


def batches(items: Sequence[Item], batch_size: int) -> list[list[Item]]:
    """``items`` in consecutive batches of at most ``batch_size``."""
    return [list(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]
