"""The one micro-batch type every data source yields and the trainer, samplers and model consume.

A micro-batch is ``b`` rows of ``s`` tokens. Two cases of the same contract:

- **dense**: one sample per row, all of the same grid, no padding (``b`` images of one size);
- **packed** (THD): ``b == 1`` and the row holds several samples back to back, sample ``i`` at
  ``starts[i] : starts[i] + seqlens[i]``, padding (zero tokens, ``token_to_sample == -1``) after
  each sample up to the next start (Transformer Engine's ``cu_seqlens`` / ``cu_seqlens_padded``).

Host-side integers (``seqlens``, ``starts``) are computed once when the batch is built, on the
host, so nothing downstream syncs with the device to learn the layout; tensors move to the run's
device once (:meth:`MicroBatch.to`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from energon_data.tokens import grid_positions


def cumsum0(lengths: Sequence[int]) -> torch.Tensor:
    """int32 ``[n+1]`` cumulative ``lengths`` from 0 (``cu_seqlens`` from per-sample lengths)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if len(lengths):
        out[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
    return out


@dataclass
class MicroBatch:
    """Clean tokens plus everything the model needs to know about the samples in them."""

    tokens: torch.Tensor
    """``[b, s, D]`` clean patch tokens (``D = C*pt*ph*pw``); packed batches have ``b == 1``."""
    labels: torch.Tensor
    """``[n]`` int64 class label per sample, ``-1`` where a sample has none."""
    grids: torch.Tensor
    """``[n, 3]`` int64 token grid ``(t, h, w)`` per sample (stays on the host)."""
    cu_seqlens: torch.Tensor
    """``[n+1]`` int32 cumulative real token counts."""
    cu_seqlens_padded: Optional[torch.Tensor]
    """``[n+1]`` int32 start offset of each sample in the flattened ``b*s`` token stream (last =
    ``b*s``); None when samples sit back to back without padding (then it equals ``cu_seqlens``)."""
    token_to_sample: torch.Tensor
    """``[b*s]`` int64 sample index of every token of the flattened stream, ``-1`` for padding."""
    positions: torch.Tensor
    """``[b*s, 3]`` int64 ``(t, h, w)`` coordinate of every token inside its sample's grid."""
    seqlens: tuple
    """Host ints: real tokens per sample."""
    starts: tuple
    """Host ints: first token of each sample in the flattened stream."""
    text_emb: Optional[torch.Tensor] = None
    """``[L_total, D_text]`` text embeddings of all samples concatenated, when the data has text."""
    cu_seqlens_text: Optional[torch.Tensor] = None
    """``[n+1]`` int32 cumulative text lengths (offsets into ``text_emb``)."""
    num_skipped: int = 0
    """Samples the source skipped (corrupt, too long …) since its previous batch, on this rank."""
    text_seqlens: Optional[tuple] = None
    """Host ints: text tokens per sample (derived from ``cu_seqlens_text`` when the batch is built)."""

    def __post_init__(self):
        if self.cu_seqlens_text is not None and self.text_seqlens is None:
            cu = self.cu_seqlens_text.tolist()  # built on the host: no device sync
            self.text_seqlens = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def dense(cls, tokens: torch.Tensor, grid: Sequence[int], labels: torch.Tensor, **extra) -> "MicroBatch":
        """``b`` samples of the same ``grid``, tokens ``[b, s, D]``."""
        b, s, _ = tokens.shape
        t, h, w = (int(g) for g in grid)
        if t * h * w != s:
            raise ValueError(f"grid {tuple(grid)} has {t * h * w} tokens but the batch rows have {s}")
        return cls(tokens=tokens, labels=labels.long(), grids=torch.tensor([[t, h, w]] * b, dtype=torch.int64),
                   cu_seqlens=(torch.arange(b + 1, dtype=torch.int32) * s), cu_seqlens_padded=None,
                   token_to_sample=torch.arange(b).repeat_interleave(s),
                   positions=grid_positions((t, h, w)).repeat(b, 1),
                   seqlens=(s,) * b, starts=tuple(range(0, b * s, s)), **extra)

    @classmethod
    def packed(cls, tokens: torch.Tensor, cu_seqlens: torch.Tensor, grids: torch.Tensor, labels: torch.Tensor,
               cu_seqlens_padded: Optional[torch.Tensor] = None, *, token_to_sample: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None, **extra) -> "MicroBatch":
        """Samples laid out in one stream, tokens ``[T, D]`` (or ``[1, T, D]``); ``token_to_sample`` and
        ``positions`` are derived from the layout when the caller has not computed them."""
        if tokens.dim() == 2:
            tokens = tokens.unsqueeze(0)
        total = tokens.shape[1]
        seqlens = tuple((cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
        starts = tuple((cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)[:-1].tolist())
        if token_to_sample is None or positions is None:
            token_to_sample = torch.full((total,), -1, dtype=torch.int64)
            positions = torch.zeros(total, 3, dtype=torch.int64)
            for i, (start, n) in enumerate(zip(starts, seqlens)):
                token_to_sample[start:start + n] = i
                positions[start:start + n] = grid_positions(grids[i].tolist())
        if cu_seqlens_padded is not None and torch.equal(cu_seqlens_padded, cu_seqlens):
            cu_seqlens_padded = None
        return cls(tokens=tokens, labels=labels.long(), grids=grids.long(), cu_seqlens=cu_seqlens.int(),
                   cu_seqlens_padded=None if cu_seqlens_padded is None else cu_seqlens_padded.int(),
                   token_to_sample=token_to_sample, positions=positions, seqlens=seqlens, starts=starts, **extra)

    # ------------------------------------------------------------------ layout
    @property
    def has_text(self) -> bool:
        return self.text_emb is not None

    @property
    def num_samples(self) -> int:
        return len(self.seqlens)

    @property
    def is_packed(self) -> bool:
        """False when every row is exactly one sample without padding (the dense fast path applies)."""
        rows, s = self.tokens.shape[:2]
        return rows != self.num_samples or any(n != s for n in self.seqlens)

    @property
    def num_real_tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens, default=0)

    @property
    def real_mask(self) -> torch.Tensor:
        """``[b, s]`` bool, True on real (non-padding) tokens."""
        return (self.token_to_sample >= 0).view(self.tokens.shape[:2])

    def to(self, device, non_blocking: bool = True) -> "MicroBatch":
        """The batch with its tensors on ``device`` (grids and host ints stay on the host). To a GPU
        without blocking, host tensors go through page-locked memory first: a copy from pageable
        memory makes the host stage it through the driver's bounce buffer (an H100's host spent 40 ms
        per MovieGen-3B step of four 8k-token micro-batches in these copies while the device, waiting
        for the host, idled); from pinned memory the copy is queued and the host goes on."""
        device = torch.device(device)
        pin = non_blocking and device.type == "cuda"
        moved = {f.name: _to(getattr(self, f.name), device, non_blocking, pin)
                 for f in dataclasses.fields(self)
                 if f.name != "grids" and isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


def _to(t: torch.Tensor, device: torch.device, non_blocking: bool, pin: bool) -> torch.Tensor:
    """``t`` on ``device``; through page-locked memory first when ``pin`` and ``t`` is a pageable host
    tensor (the pinned copy's block is not reused before the device has read it: torch's host
    allocator records the copy)."""
    if pin and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)
