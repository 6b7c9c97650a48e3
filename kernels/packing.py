"""Laying out a packed (THD) sequence for context parallelism.

Layout decision: each sample is padded at its end to a multiple of ``multiple`` (default the CP
size; pass e.g. ``CP*TP*2`` when sequence-parallel TP or TransformerEngine's THD zig-zag layout
must also divide each sample), the stream gets tail padding up to a multiple of the CP size,
and the whole padded stream is split **contiguously** into equal shards, rank ``r`` taking
``[r*L, (r+1)*L)``. For non-causal attention every (query, key) tile costs the same, so this is
already balanced, and samples may straddle ranks freely; the CP ops take the global
``(cu_seqlens, cu_seqlens_padded)`` pair and never attend to padding.

Strictly only the total must divide by the CP size; per-sample padding is kept so the layout is
also valid for per-sample splitting schemes (TE/Megatron THD) with the same ``multiple``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .host_copy import to_device


@dataclass(frozen=True)
class CPPackedLayout:
    """Padded layout of one packed sequence and the index maps between it and the real tokens."""

    cp_size: int
    """Number of context-parallel ranks the padded stream is split over."""
    cu_seqlens: torch.Tensor
    """int32 [n+1]: cumulative real lengths (the input)."""
    cu_seqlens_padded: torch.Tensor
    """int32 [n+1]: cumulative padded lengths; sample i starts at cu_seqlens_padded[i], real tokens first."""
    total_len: int
    """Length of the padded stream (>= cu_seqlens_padded[-1]; a multiple of cp_size)."""
    real_index: torch.Tensor
    """int64 [cu_seqlens[-1]]: position in the padded stream of each real token, in order."""

    @property
    def shard_len(self) -> int:
        """Tokens per rank."""
        return self.total_len // self.cp_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s contiguous shard in the padded stream."""
        return rank * self.shard_len, (rank + 1) * self.shard_len

    def is_real(self) -> torch.Tensor:
        """bool [total_len]: True on real tokens, False on padding."""
        mask = torch.zeros(self.total_len, dtype=torch.bool)
        mask[self.real_index] = True
        return mask

    def pad(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Scatter the real tokens ``x`` (``cu_seqlens[-1]`` along ``dim``) into a zero-padded stream."""
        shape = list(x.shape)
        shape[dim] = self.total_len
        return x.new_zeros(shape).index_copy(dim, to_device(self.real_index, x.device), x)

    def unpad(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Gather the real tokens back out of a padded stream (inverse of :meth:`pad`)."""
        return x.index_select(dim, to_device(self.real_index, x.device))

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s contiguous slice of a padded stream."""
        start, end = self.shard_range(rank)
        return x.narrow(dim, start, end - start)

    def local_cu_seqlens(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_seqlens, cu_seqlens_padded)`` of the pieces of every sample on ``rank``'s shard, in
        shard-local coordinates, one entry per sample of the pack (empty for samples elsewhere).
        Use them for rank-local ops such as :func:`kernels.cross_attention`."""
        start, end = self.shard_range(rank)
        starts = self.cu_seqlens_padded[:-1].long()
        real_ends = starts + (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        local_starts = (starts - start).clamp(0, end - start)
        local_padded_ends = (self.cu_seqlens_padded[1:].long() - start).clamp(0, end - start)
        local_real = (real_ends - start).clamp(0, end - start) - local_starts
        zero = torch.zeros(1, dtype=torch.long)
        cu_padded = torch.cat([zero, local_padded_ends])
        cu_real = torch.cat([zero, local_real.cumsum(0)])
        return cu_real.to(torch.int32), cu_padded.to(torch.int32)


def split_packed_for_cp(cu_seqlens, cp_size: int, multiple: int | None = None) -> CPPackedLayout:
    """Pad each sample of a packed sequence to ``multiple`` (default ``cp_size``) and the stream to a
    multiple of ``cp_size``; see the module doc for the layout."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    multiple = cp_size if multiple is None else multiple
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    cu = torch.as_tensor(cu_seqlens).to(torch.long).cpu()
    if cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be a non-decreasing 1-D [n+1] tensor starting at 0, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    padded = (lengths + multiple - 1) // multiple * multiple
    cu_padded = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
    total = -(-int(cu_padded[-1]) // cp_size) * cp_size
    if total == 0:
        raise ValueError("cu_seqlens describe an empty pack; there is nothing to split")
    real_index = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(cu_padded[:-1], lengths)])
    return CPPackedLayout(cp_size=cp_size, cu_seqlens=cu.to(torch.int32), cu_seqlens_padded=cu_padded.to(torch.int32),
                          total_len=total, real_index=real_index)
