"""Text conditioning: the per-sample text a micro-batch carries, its embedder, and the
cross-attention pattern from a query layout to the text.

Text is ragged: sample ``i`` has ``lens[i]`` text tokens, concatenated without padding into one
``[L_total, text_dim]`` tensor (energon's ``text_emb`` / ``cu_seqlens_text``). Cross-attention is
block-diagonal between the query stream and that text stream, whatever the query layout (dense
rows, a packed stream, a context-parallel piece of it), so it runs through the same segment
kernels as packed self-attention, with no padding of the text.

Classifier-free guidance drops a sample's text to a learned null embedding. The sample keeps its
layout: every one of its text tokens becomes the null vector, and attention over ``L`` identical
keys equals attention to one null key, so dropping needs no new layout and no host sync.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from dit_mcore.kernels.host_copy import to_device
from dit_mcore.kernels.segments import Segments


@dataclass
class TextContext:
    """The text of ``n`` samples: ``emb [L_total, text_dim]`` with ``lens`` tokens each (host ints),
    and ``keep [n]`` (bool, optional): False replaces that sample's text by the null text."""

    emb: torch.Tensor
    lens: tuple
    keep: Optional[torch.Tensor] = None

    def __post_init__(self):
        self.lens = tuple(int(n) for n in self.lens)
        if self.emb.dim() != 2 or self.emb.shape[0] != sum(self.lens):
            raise ValueError(f"text embeddings {tuple(self.emb.shape)} must be [L_total, text_dim] with "
                             f"L_total = sum of the per-sample lengths {sum(self.lens)}")
        if min(self.lens, default=1) < 1:
            raise ValueError(f"every sample needs at least one text token (an empty caption still has the "
                             f"encoder's special tokens), got lengths {self.lens}")

    @classmethod
    def from_batch(cls, batch, keep: Optional[torch.Tensor] = None) -> "TextContext":
        """The text of a ``MicroBatch`` (its host ints ``text_seqlens`` give the layout)."""
        return cls(batch.text_emb, batch.text_seqlens, keep)

    @classmethod
    def from_list(cls, embs: Sequence[torch.Tensor]) -> "TextContext":
        """From one ``[L_i, text_dim]`` tensor per sample."""
        return cls(torch.cat(list(embs)), tuple(len(e) for e in embs))

    @property
    def num_samples(self) -> int:
        return len(self.lens)

    def dropped(self) -> "TextContext":
        """The same layout with every text dropped to the null text (the unconditional half)."""
        return dataclasses.replace(self, keep=torch.zeros(self.num_samples, dtype=torch.bool,
                                                          device=self.emb.device))

    def with_null(self) -> "TextContext":
        """``2n`` samples: these, then :meth:`dropped` (for one guided call)."""
        keep = self.keep if self.keep is not None else torch.ones(self.num_samples, dtype=torch.bool,
                                                                  device=self.emb.device)
        return TextContext(torch.cat([self.emb, self.emb]), self.lens * 2,
                           torch.cat([keep, self.dropped().keep]))

    def take(self, samples: Sequence[int]) -> "TextContext":
        """The text of ``samples`` (host indices, repeats allowed), in that order."""
        offsets = [0]
        for n in self.lens:
            offsets.append(offsets[-1] + n)
        rows = [r for i in samples for r in range(offsets[i], offsets[i + 1])]
        index = to_device(rows, self.emb.device, torch.int64)
        keep = None if self.keep is None else self.keep[to_device(list(samples), self.keep.device, torch.int64)]
        return TextContext(self.emb[index], tuple(self.lens[i] for i in samples), keep)

    def to(self, device) -> "TextContext":
        return dataclasses.replace(self, emb=to_device(self.emb, device),
                                   keep=None if self.keep is None else to_device(self.keep, device))


class TextEmbedder(nn.Module):
    """Text embeddings -> the model width (PixArt's caption projection: Linear, tanh-GELU, Linear),
    with a learned null text for classifier-free guidance. Runs once per forward; every layer's
    cross-attention reads its output."""

    def __init__(self, text_dim: int, hidden_size: int):
        super().__init__()
        self.null = nn.Parameter(torch.randn(text_dim) / text_dim ** 0.5)
        self.proj = nn.Sequential(nn.Linear(text_dim, hidden_size), nn.GELU(approximate="tanh"),
                                  nn.Linear(hidden_size, hidden_size))
        for layer in (self.proj[0], self.proj[2]):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, text: TextContext) -> torch.Tensor:
        """``[L_total, 1, hidden]``: megatron's ``[s, b, h]`` with the text as one stream."""
        dtype = self.proj[0].weight.dtype
        emb = text.emb.to(dtype)
        if emb.shape[-1] != self.null.shape[0]:
            raise ValueError(f"text embeddings have width {emb.shape[-1]} but the model was built for "
                             f"model.text_dim={self.null.shape[0]}; set model.text_dim to the dataset's text "
                             "encoder width")
        if text.keep is not None:
            owner = torch.repeat_interleave(torch.arange(text.num_samples), torch.tensor(text.lens))
            keep = text.keep[to_device(owner, text.keep.device)].unsqueeze(-1)
            emb = torch.where(keep, emb, self.null.to(dtype))
        return self.proj(emb).unsqueeze(1)


def cross_segments(query_ranges: Sequence[tuple[int, int]], text_lens: Sequence[int]) -> Segments:
    """Cross-attention pattern: query tokens ``[a_i, e_i)`` of sample ``i`` attend to that sample's
    text tokens. Samples with no query token here (on another context-parallel rank) are left out;
    query tokens in no range (padding) get zero output."""
    if len(query_ranges) != len(text_lens):
        raise ValueError(f"{len(query_ranges)} query samples but text for {len(text_lens)}: every sample "
                         "needs its text (a dropped text is still there, as the null text)")
    q_starts, q_ends, k_starts, k_ends, offset = [], [], [], [], 0
    for (a, e), n in zip(query_ranges, text_lens):
        if e > a:
            q_starts.append(a)
            q_ends.append(e)
            k_starts.append(offset)
            k_ends.append(offset + n)
        offset += n
    return Segments(tuple(q_starts), tuple(q_ends), tuple(k_starts), tuple(k_ends))
