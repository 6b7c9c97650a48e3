"""Sample types on the loading path: raw latent sample -> encoded (patchified) sample -> pack -> batch.

Token layout (shared with ``dit_mcore.models.patching``): a latent ``[C, T, H, W]`` with patch sizes
``(pt, ph, pw)`` becomes ``t*h*w`` tokens (``t = T/pt``, ...) ordered frame-major, then row, then
column; the ``C*pt*ph*pw`` values of one token are ordered ``(C, pt, ph, pw)``, the flattening of a
Conv3d / Linear patch-embedding weight ``[hidden, C, pt, ph, pw]``.

THD convention of :class:`LatentBatch` (the same as Transformer Engine's ``cu_seqlens_q`` /
``cu_seqlens_q_padded``): all samples of a micro-batch are laid out in ONE token sequence
``tokens [T_total, D]``; sample ``i`` occupies rows
``cu_seqlens_padded[i] : cu_seqlens_padded[i] + (cu_seqlens[i+1] - cu_seqlens[i])`` and the rows after
it up to ``cu_seqlens_padded[i+1]`` are padding.

- ``cu_seqlens``: cumulative REAL token counts ``[0, l0, l0+l1, ...]`` (not positions in ``tokens``).
- ``cu_seqlens_padded``: start offsets of each sample in ``tokens``; ``cu_seqlens_padded[-1] == T_total``
  and every difference is a multiple of ``pad_multiple``. When packing, the padding that fills a
  pack up to ``max_seq_len`` is attributed to the last sample of that pack.
"""
from __future__ import annotations

import torch
from megatron.energon import Batch, Sample
from megatron.energon.edataclass import edataclass


@edataclass
class LatentSample(Sample):
    """One prepared sample as stored in the shards (see ``.nv-meta/dataset.yaml``)."""

    #: bf16 latent ``[C, T, H, W]``; ``T == 1`` for images.
    latent: torch.Tensor
    #: bf16 text embedding ``[L, D_text]``.
    text_emb: torch.Tensor
    #: json metadata: kind, height, width, frames, fps, caption, source and an optional int label.
    meta: dict


@edataclass
class EncodedSample(Sample):
    """A patchified sample, ready to be packed."""

    #: ``[t*h*w, C*pt*ph*pw]`` in the latent's dtype (patchify is a pure permutation).
    tokens: torch.Tensor
    #: ``[L, D_text]``.
    text_emb: torch.Tensor
    #: token grid ``(t, h, w)``.
    grid: tuple[int, int, int]
    #: class label from the json, ``-1`` if the sample has none.
    label: int
    #: number of rows this sample takes in a pack: ``len(tokens)`` rounded up to ``pad_multiple``.
    padded_len: int


@edataclass
class PackedSample(Sample):
    """Several encoded samples laid out in one sequence of exactly ``max_seq_len`` rows.

    ``cu_seqlens`` / ``cu_seqlens_padded`` follow the module docstring's convention, relative to
    this pack. ``__key__`` is the comma-joined sample keys; ``keys`` has them individually.
    """

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    text_emb: torch.Tensor
    cu_seqlens_text: torch.Tensor
    #: ``[n, 3]`` int64 token grids.
    grids: torch.Tensor
    #: ``[n]`` int64 labels (``-1`` = none).
    labels: torch.Tensor
    keys: list[str]


@edataclass
class LatentBatch(Batch):
    """A micro-batch in THD layout; what the trainer consumes (``tokens[:, None, :]`` is ``[T, 1, D]``).

    Samples are indexed ``0..n-1`` in batch order; packs are contiguous blocks of samples.
    """

    #: ``[T_total, D]`` patch tokens (padding rows are zero).
    tokens: torch.Tensor
    #: ``[n+1]`` int32 cumulative real lengths (TE ``cu_seqlens_q``).
    cu_seqlens: torch.Tensor
    #: ``[n+1]`` int32 start offsets in ``tokens`` (TE ``cu_seqlens_q_padded``); last == ``T_total``.
    cu_seqlens_padded: torch.Tensor
    #: ``[T_total]`` int64 sample index of every row, ``-1`` for padding.
    sample_ids: torch.Tensor
    #: ``[T_total, 3]`` int64 ``(t, h, w)`` position of every row inside its sample's grid (0 for padding).
    positions: torch.Tensor
    #: ``[n, 3]`` int64 token grids ``(t, h, w)``.
    grids: torch.Tensor
    #: ``[n]`` int64 class labels, ``-1`` where the sample has none.
    labels: torch.Tensor
    #: ``[L_total, D_text]`` text embeddings of all samples, concatenated without padding.
    text_emb: torch.Tensor
    #: ``[n+1]`` int32 cumulative text lengths (also the offsets into ``text_emb``).
    cu_seqlens_text: torch.Tensor
    #: ``[num_packs]`` int64 number of samples in each pack (all ones when packing is off).
    samples_per_pack: torch.Tensor
    #: per-sample keys, in batch order.
    keys: list[str]
    #: samples skipped (all reasons) by the data worker that built this batch since that worker's
    #: previous batch. Per rank: summing it over this rank's batches gives the rank's total;
    #: sum over DP ranks (e.g. all-reduce) for a global count.
    num_skipped: int
    #: the same count split by reason (``nonfinite``, ``too_long``, ``too_large``, ``bad_shape``).
    skipped_by_reason: dict[str, int]
    #: id of the data worker that built the batch (``-1`` without workers).
    worker_id: int = -1

    @property
    def num_samples(self) -> int:
        return len(self.keys)

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[T_total]`` bool, True on real (non-padding) tokens."""
        return self.sample_ids >= 0

    @property
    def seqlens(self) -> torch.Tensor:
        """``[n]`` real token count per sample."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def max_seqlen(self) -> int:
        return int(self.seqlens.max()) if self.num_samples else 0

