"""Ulysses (head-parallel) attention and its composition with a ring (USP / TE ``a2a+p2p``).

One all-to-all of the packed Q‖K‖V swaps the sequence shard for a head shard, attention runs on
the full sequence of ``h / U`` heads (locally, or as a ring over an outer group), and one
all-to-all swaps the output back. Every piece is an autograd op, so the backward is the mirror
image: two (three with lse) all-to-alls.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_to_all
from .local_attention import Segments, segment_attention
from .ring import ring_attention


def check_heads(heads: int, kv_heads: int, degree: int) -> None:
    """Raise if ``heads``/``kv_heads`` cannot be split over ``degree`` Ulysses ranks."""
    if heads % degree:
        raise ValueError(f"Ulysses degree {degree} must divide the number of attention heads ({heads}); "
                         f"use a degree that divides {heads}, or method='p2p'/'all_gather' (no head limit)")
    if kv_heads % degree and degree % kv_heads:
        raise ValueError(f"Ulysses degree {degree} and kv heads {kv_heads}: one must divide the other "
                         f"(kv heads are replicated when degree > kv heads); change the degree")


def heads_to_sequence(q, k, v, group):
    """Sequence-sharded q/k/v ``[b, s, h, d]`` -> head-sharded ``[b, U*s, h/U, d]`` in one all-to-all."""
    degree = dist.get_world_size(group)
    b, s, h, d = q.shape
    hk = k.shape[2]
    check_heads(h, hk, degree)
    if hk % degree:  # degree > kv heads: replicate so each rank gets the kv head of its query heads
        k, v = k.repeat_interleave(degree // hk, dim=2), v.repeat_interleave(degree // hk, dim=2)
        hk = degree
    parts = [t.reshape(b, s, degree, t.shape[2] // degree, d) for t in (q, k, v)]
    qkv = torch.cat(parts, dim=3).reshape(b, s, degree * (h + 2 * hk) // degree, d)
    qkv = all_to_all(qkv, scatter_dim=2, gather_dim=1, group=group)
    return qkv.split([h // degree, hk // degree, hk // degree], dim=2)


def sequence_to_heads(out, lse, group):
    """Inverse of :func:`heads_to_sequence` for the output (and lse when not None)."""
    out = all_to_all(out, scatter_dim=1, gather_dim=2, group=group)
    if lse is not None:
        lse = all_to_all(lse, scatter_dim=2, gather_dim=1, group=group)
    return out, lse


def ulysses_attention(q, k, v, *, group, segments: Segments | None = None, softmax_scale: float,
                      backend="auto", return_lse=False, ring_group=None):
    """Ulysses over ``group``; with ``ring_group`` the full-sequence attention is itself a ring over
    it (USP): the a2a group must be the inner, contiguous ranks of the cp group."""
    qh, kh, vh = heads_to_sequence(q, k, v, group)
    if ring_group is None:
        out, lse = segment_attention(qh, kh, vh, segments=segments, softmax_scale=softmax_scale, backend=backend)
    else:
        out, lse = ring_attention(qh, kh, vh, group=ring_group, segments=segments, softmax_scale=softmax_scale,
                                  backend=backend)
    return sequence_to_heads(out, lse if return_lse else None, group)
