"""All-gather-KV context-parallel attention ("llama3" CP, TE ``all_gather``).

Each rank gathers the full K/V, runs one local attention of its query shard against it, and in
the backward reduce-scatters dK/dV. One kernel call per head group means no lse merge (best
numerics) and any packing works. K/V are gathered ``kv_head_stride`` kv heads at a time and
regathered in the backward instead of being kept, so peak memory holds only that slice of the
full K/V.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_gather_dim, reduce_scatter_dim
from .local_attention import Segments, attention_backward, attention_forward


def _head_groups(kv_heads, stride):
    stride = kv_heads if stride is None else stride
    if stride < 1:
        raise ValueError(f"kv_head_stride must be >= 1, got {stride}")
    return [(lo, min(lo + stride, kv_heads)) for lo in range(0, kv_heads, stride)]


def _local_segments(segments, group, s_local):
    """This rank's queries against the gathered keys (global coordinates on the key side)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return None if segments is None else segments.restrict(rank * s_local, (rank + 1) * s_local, 0, world * s_local)


def all_gather_forward(q, k, v, *, segments, scale, backend, group, kv_head_stride=None):
    """``(out, lse)``: K/V gathered ``kv_head_stride`` kv heads at a time, one attention per head group."""
    seg = _local_segments(segments, group, q.shape[1])
    g = q.shape[2] // k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    for lo, hi in _head_groups(k.shape[2], kv_head_stride):
        kv = all_gather_dim(torch.stack([k[:, :, lo:hi], v[:, :, lo:hi]]), 2, group)
        o, l = attention_forward(q[:, :, lo * g:hi * g], kv[0], kv[1], segments=seg, softmax_scale=scale,
                                 backend=backend)
        out[:, :, lo * g:hi * g] = o
        lse[:, lo * g:hi * g] = l
    return out, lse


def all_gather_backward(dout, q, k, v, out, lse, *, segments, scale, backend, group, kv_head_stride=None, dlse=None):
    """``(dq, dk, dv)`` of :func:`all_gather_forward`: K/V regathered, dK/dV reduce-scattered in fp32."""
    seg = _local_segments(segments, group, q.shape[1])
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    g = q.shape[2] // k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for lo, hi in _head_groups(k.shape[2], kv_head_stride):
        hq = slice(lo * g, hi * g)
        kv = all_gather_dim(torch.stack([k[:, :, lo:hi], v[:, :, lo:hi]]), 2, group)
        dq_h, dk_h, dv_h = attention_backward(
            dout[:, :, hq], q[:, :, hq], kv[0], kv[1], out[:, :, hq], lse[:, hq], segments=seg,
            softmax_scale=scale, dlse=None if dlse is None else dlse[:, hq], backend=backend)
        acc = torch.promote_types(k.dtype, torch.float32)  # sum the ranks' shares in fp32
        dkv = reduce_scatter_dim(torch.stack([dk_h, dv_h]).to(acc), 2, group)
        dq[:, :, hq] = dq_h
        dk[:, :, lo:hi] = dkv[0].to(k.dtype)
        dv[:, :, lo:hi] = dkv[1].to(v.dtype)
    return dq, dk, dv


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, scale, backend, group, kv_head_stride):
        ctx.set_materialize_grads(False)  # an unused lse must arrive as dlse=None (fused backward)
        out, lse = all_gather_forward(q, k, v, segments=segments, scale=scale, backend=backend, group=group,
                                      kv_head_stride=kv_head_stride)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kw = dict(segments=segments, scale=scale, backend=backend, group=group, kv_head_stride=kv_head_stride)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return None, None, None, None, None, None, None, None
        dq, dk, dv = all_gather_backward(dout, *ctx.saved_tensors, dlse=dlse, **ctx.kw)
        return dq, dk, dv, None, None, None, None, None


def all_gather_attention(q, k, v, *, group, segments: Segments | None = None, softmax_scale: float,
                         backend="auto", kv_head_stride: int | None = None):
    """``(out, lse)`` of this rank's query shard against the gathered K/V of ``group``.

    ``kv_head_stride``: kv heads gathered per collective (None: all at once, fewest collectives).
    """
    return _AllGatherAttention.apply(q, k, v, segments, softmax_scale, backend, group, kv_head_stride)
