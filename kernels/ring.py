"""Ring ("p2p") context-parallel attention for non-causal, contiguously sharded sequences.

Q stays on its rank; K and V, packed into one buffer, travel round the ring in ``P - 1``
double-buffered ``batch_isend_irecv`` steps, so the transfer for step ``i + 1`` overlaps the
attention of step ``i``. Partial ``(out, lse)`` pairs are merged in fp32. The backward sends K/V
round again with a fp32 dK/dV buffer travelling alongside, each rank adding its contribution;
after ``P`` hops the buffer reaches the block's owner.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import RingExchange
from .local_attention import Segments, attention_backward, attention_forward

_KV_TAG, _DKV_TAG = 0, 1  # gloo matches point-to-point messages by tag; NCCL ignores it


def merge_attention(out, lse, block_out, block_lse):
    """Fold one block's ``(out, lse)`` into the running fp32 pair.

    ``out += sigmoid(lse_b - lse) * (out_b - out)`` and ``lse = logaddexp(lse, lse_b)``, which is
    the ``lse - logsigmoid(lse - lse_b)`` update written so that rows with no key so far
    (``lse = -inf`` on either or both sides) stay finite instead of producing ``inf - inf``.
    """
    if out is None:
        return block_out.float(), block_lse.clone()
    weight = torch.sigmoid(block_lse - lse).nan_to_num_(0.0)  # both -inf -> nothing to take
    out.add_(weight.transpose(1, 2).unsqueeze(-1) * (block_out.float() - out))
    return out, torch.logaddexp(lse, block_lse)


def _block_segments(segments, rank, src, q_len, kv_len):
    if segments is None:
        return None
    return segments.restrict(rank * q_len, (rank + 1) * q_len, src * kv_len, (src + 1) * kv_len)


def ring_forward(q, k, v, *, segments, scale, backend, group):
    """``(out, lse)``: K/V round the ring, the blocks' partial results merged in fp32."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    s_local = q.shape[1]
    bufs = [torch.stack([k, v]).contiguous(), None]
    if world > 1:
        bufs[1] = torch.empty_like(bufs[0])
        ring = RingExchange(group, tag=_KV_TAG)
    out = lse = None
    for step in range(world):
        kv = bufs[step % 2]
        if step < world - 1:
            ring.start(kv, bufs[(step + 1) % 2])
        seg = _block_segments(segments, rank, (rank - step) % world, s_local, s_local)
        block_out, block_lse = attention_forward(q, kv[0], kv[1], segments=seg, softmax_scale=scale, backend=backend)
        out, lse = merge_attention(out, lse, block_out, block_lse)
        if step < world - 1:
            ring.wait()
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, *, segments, scale, backend, group, dlse=None):
    """``(dq, dk, dv)`` of :func:`ring_forward`: K/V round the ring again, a fp32 dK/dV buffer beside them."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    s_local = q.shape[1]
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kv_bufs = [torch.stack([k, v]).contiguous(), None]
    dkv_bufs = [torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device), None]
    if world > 1:
        kv_bufs[1] = torch.empty_like(kv_bufs[0])
        dkv_bufs[1] = torch.empty_like(dkv_bufs[0])
        kv_ring = RingExchange(group, tag=_KV_TAG)
        dkv_ring = RingExchange(group, tag=_DKV_TAG)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    for step in range(world):
        kv = kv_bufs[step % 2]
        if step < world - 1:
            kv_ring.start(kv, kv_bufs[(step + 1) % 2])
        seg = _block_segments(segments, rank, (rank - step) % world, s_local, s_local)
        dq_b, dk_b, dv_b = attention_backward(dout, q, kv[0], kv[1], out, lse, segments=seg, softmax_scale=scale,
                                              dlse=dlse, backend=backend)
        dq += dq_b
        if step > 0:
            dkv_ring.wait()  # partial dK/dV of this block from the ranks before us
        dkv = dkv_bufs[step % 2]
        dkv[0] += dk_b
        dkv[1] += dv_b
        if world > 1:
            dkv_ring.start(dkv, dkv_bufs[(step + 1) % 2])
        if step < world - 1:
            kv_ring.wait()
    if world > 1:
        dkv_ring.wait()  # our own block's dK/dV, complete, from the previous rank
    dkv = dkv_bufs[world % 2] if world > 1 else dkv_bufs[0]
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, scale, backend, group):
        ctx.set_materialize_grads(False)  # an unused lse must arrive as dlse=None (fused backward)
        out, lse = ring_forward(q, k, v, segments=segments, scale=scale, backend=backend, group=group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.scale, ctx.backend, ctx.group = segments, scale, backend, group
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return None, None, None, None, None, None, None
        dq, dk, dv = ring_backward(dout, *ctx.saved_tensors, segments=ctx.segments, scale=ctx.scale,
                                   backend=ctx.backend, group=ctx.group, dlse=dlse)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, *, group, segments: Segments | None = None, softmax_scale: float, backend="auto"):
    """``(out, lse)`` of this rank's query shard against the whole sequence, K/V passed round ``group``.

    Shards are contiguous and equal in the group's rank order; ``segments`` (global coordinates)
    give the packed pattern of the full sequence.
    """
    return _RingAttention.apply(q, k, v, segments, softmax_scale, backend, group)
