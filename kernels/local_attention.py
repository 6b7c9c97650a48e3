"""Single-device (non-causal) attention, dense or packed, with the log-sum-exp every ring needs.

Layout everywhere in ``kernels``: q ``[b, s_q, h, d]``, k/v ``[b, s_kv, h_kv, d]`` with
``h % h_kv == 0`` (GQA: query head ``j`` reads kv head ``j // (h // h_kv)``), lse float32
``[b, h, s_q]``.

Packed input is described by :class:`Segments`: query segment ``i`` covers tokens
``[q_starts[i], q_ends[i])`` and attends only to key tokens ``[kv_starts[i], kv_ends[i])``.
Tokens in no segment are padding: their output is 0, their lse is ``-inf`` and they get no
gradient. Segments may be empty, which is what a context-parallel shard sees when a sample lies
on another rank; a query row with no key gets out 0 and lse ``-inf`` and merges safely.

The parallel ops are built on two primitives, as flash-attention is:
:func:`attention_forward` (any backend, returns ``(out, lse)``, no autograd) and
:func:`attention_backward` (fp32 math from ``(dout, q, k, v, out, lse)``, optionally with a
gradient on lse). :func:`local_attention` wraps them into an autograd op.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "flash_cpu", "flex", "flash_attn", "math64")

# Cap on score-matrix elements materialised at once by the math paths (fp32: 256 MiB).
_MAX_SCORE_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Segments:
    """Block-diagonal attention pattern of a packed (THD) sequence, as host-side int tuples."""

    q_starts: tuple
    """First query token of each segment."""
    q_ends: tuple
    """One past the last real query token of each segment (tokens up to the next start are padding)."""
    kv_starts: tuple
    """First key token of each segment."""
    kv_ends: tuple
    """One past the last real key token of each segment."""

    @staticmethod
    def from_cu_seqlens(cu_seqlens_q, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                        cu_seqlens_kv_padded=None) -> "Segments":
        """Segments from cumulative lengths.

        Without ``*_padded`` segment ``i`` is ``[cu[i], cu[i+1])``. With them (TransformerEngine's
        convention) ``cu`` holds the cumulative *real* lengths and segment ``i`` starts at
        ``cu_padded[i]`` with its real tokens first; the rest up to ``cu_padded[i+1]`` is padding.
        The q and kv sides are independent: pass both ``*_padded`` for padded self-attention.
        """
        cu_seqlens_kv = cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv
        qs, qe = _starts_ends(cu_seqlens_q, cu_seqlens_q_padded, "cu_seqlens_q")
        ks, ke = _starts_ends(cu_seqlens_kv, cu_seqlens_kv_padded, "cu_seqlens_kv")
        if len(qs) != len(ks):
            raise ValueError(f"cu_seqlens_q has {len(qs)} segments but cu_seqlens_kv has {len(ks)}; "
                             "pass one entry per sample to both (empty segments are allowed)")
        return Segments(qs, qe, ks, ke)

    def restrict(self, q0: int, q1: int, k0: int, k1: int) -> "Segments":
        """The pattern seen by the query block ``[q0, q1)`` against the key block ``[k0, k1)``,
        in block-local coordinates (segments outside a block become empty)."""
        def clip(xs, lo, hi):
            return tuple(min(max(x - lo, 0), hi - lo) for x in xs)
        return Segments(clip(self.q_starts, q0, q1), clip(self.q_ends, q0, q1),
                        clip(self.kv_starts, k0, k1), clip(self.kv_ends, k0, k1))

    def nonempty(self):
        """(q_start, q_end, kv_start, kv_end) of segments with both queries and keys."""
        return [(a, b, c, d) for a, b, c, d in zip(self.q_starts, self.q_ends, self.kv_starts, self.kv_ends)
                if b > a and d > c]

    def max_q_end(self) -> int:
        return max(self.q_ends, default=0)

    def max_kv_end(self) -> int:
        return max(self.kv_ends, default=0)


def _starts_ends(cu, cu_padded, name):
    cu = _as_int_list(cu, name)
    if cu_padded is None:
        return tuple(cu[:-1]), tuple(cu[1:])
    cu_padded = _as_int_list(cu_padded, name + "_padded")
    if len(cu_padded) != len(cu):
        raise ValueError(f"{name}_padded must have the same length as {name} ({len(cu)}), got {len(cu_padded)}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    padded = [b - a for a, b in zip(cu_padded[:-1], cu_padded[1:])]
    if any(l > p for l, p in zip(lens, padded)):
        raise ValueError(f"{name}: a real length exceeds its padded length; {name}_padded must be "
                         f"the cumulative padded lengths (each >= the real one)")
    return tuple(cu_padded[:-1]), tuple(s + l for s, l in zip(cu_padded[:-1], lens))


def _as_int_list(cu, name):
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor [n+1], got {cu.dtype} {tuple(cu.shape)}")
        cu = cu.tolist()
    cu = [int(x) for x in cu]
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {cu}")
    return cu


# --------------------------------------------------------------------------------------------
# backend selection


@functools.lru_cache(maxsize=None)
def _log_choice(requested: str, chosen: str, device: str) -> None:
    logger.info("kernels.local_attention: backend=%r -> %s on %s", requested, chosen, device)


def _have_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """Name of the backend that will run; 'auto' prefers flash-attn on GPU, else SDPA/flash_cpu."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; choose one of {BACKENDS}")
    chosen = backend
    if backend == "auto":
        if q.is_cuda:
            chosen = "flash_attn" if (q.dtype in (torch.float16, torch.bfloat16) and _have_flash_attn()) else "sdpa"
        else:
            chosen = "flash_cpu"
    if chosen == "flash_attn" and not q.is_cuda:
        raise ValueError("backend='flash_attn' needs CUDA tensors; use backend='auto' or 'flash_cpu' on CPU")
    _log_choice(backend, chosen, q.device.type)
    return chosen


def _check_shapes(q, k, v, segments):
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [b,s_q,h,d] and k,v [b,s_kv,h_kv,d]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share batch and head_dim: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]}) for GQA")
    if segments is not None:
        if q.shape[0] != 1:
            raise ValueError(f"packed (cu_seqlens) attention needs batch size 1, got {q.shape[0]}; "
                             "concatenate the samples along the sequence instead")
        if segments.max_q_end() > q.shape[1] or segments.max_kv_end() > k.shape[1]:
            raise ValueError(f"cu_seqlens reach token {segments.max_q_end()}/{segments.max_kv_end()} but q/k "
                             f"have {q.shape[1]}/{k.shape[1]} tokens; cu_seqlens[-1] must be <= the sequence length")


# --------------------------------------------------------------------------------------------
# forward


def attention_forward(q, k, v, *, segments: Segments | None = None, softmax_scale=None, backend="auto"):
    """``(out [b,s_q,h,d] in q's dtype, lse float32 [b,h,s_q])``; no autograd graph is recorded."""
    _check_shapes(q, k, v, segments)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    name = resolve_backend(backend, q)
    q, k, v = q.detach(), k.detach(), v.detach()
    with torch.no_grad():
        if segments is None:
            return _DENSE[name](q, k, v, scale)
        b, s_q, h, d = q.shape
        out = q.new_zeros(b, s_q, h, d)
        lse = torch.full((b, h, s_q), float("-inf"), dtype=torch.float32, device=q.device)
        if name == "flex":
            return _flex_packed(q, k, v, scale, segments)
        if name == "flash_attn":
            return _flash_attn_packed(q, k, v, scale, segments)
        for a, e, c, f in segments.nonempty():
            o_i, l_i = _DENSE[name](q[:, a:e], k[:, c:f], v[:, c:f], scale)
            out[:, a:e] = o_i
            lse[:, :, a:e] = l_i
        return out, lse


def _repeat_kv(q, k, v):
    rep = q.shape[2] // k.shape[2]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


def _math_forward(q, k, v, scale, dtype):
    """Exact softmax attention in ``dtype``, chunked over kv heads to bound memory."""
    b, s_q, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    qg = q.to(dtype).reshape(b, s_q, hk, g, d)
    kd, vd = k.to(dtype), v.to(dtype)
    out = torch.empty(b, s_q, hk, g, d, dtype=dtype, device=q.device)
    lse = torch.empty(b, hk, g, s_q, dtype=dtype, device=q.device)
    for lo, hi in _head_chunks(b * g * s_q * k.shape[1], hk):
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg[:, :, lo:hi], kd[:, :, lo:hi]) * scale
        l = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - l.unsqueeze(-1))
        out[:, :, lo:hi] = torch.einsum("bhgqk,bkhd->bqhgd", p, vd[:, :, lo:hi])
        lse[:, lo:hi] = l
    return out.reshape(b, s_q, h, d).to(q.dtype), lse.reshape(b, h, s_q).float()


def _head_chunks(elements_per_head, heads):
    step = max(1, min(heads, _MAX_SCORE_ELEMENTS // max(1, elements_per_head)))
    return [(lo, min(lo + step, heads)) for lo in range(0, heads, step)]


def _math64_dense(q, k, v, scale):
    return _math_forward(q, k, v, scale, torch.float64)


def _flash_cpu_dense(q, k, v, scale):
    k, v = _repeat_kv(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2), lse.float()


def _sdpa_dense(q, k, v, scale):
    """SDPA gives no lse, so it is recomputed in fp32 (chunked); use flash_cpu/flash_attn to avoid it."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    b, s_q, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    qg = q.float().reshape(b, s_q, hk, g, d)
    lse = torch.empty(b, hk, g, s_q, dtype=torch.float32, device=q.device)
    for lo, hi in _head_chunks(b * g * s_q * k.shape[1], hk):
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg[:, :, lo:hi], k[:, :, lo:hi].float()) * scale
        lse[:, lo:hi] = torch.logsumexp(s, dim=-1)
    return out, lse.reshape(b, h, s_q)


def _flex_dense(q, k, v, scale):
    return _flex(q, k, v, scale, None)


def _flex(q, k, v, scale, mask_mod_and_lens):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if mask_mod_and_lens is not None:
        mask_mod, s_q, s_kv = mask_mod_and_lens
        block_mask = create_block_mask(mask_mod, None, None, s_q, s_kv, device=q.device.type)
    out, lse = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                              scale=scale, enable_gqa=q.shape[2] != k.shape[2], return_lse=True)
    out, lse = out.transpose(1, 2), lse.float()
    return _zero_empty_rows(out, lse)


def _zero_empty_rows(out, lse):
    # Kernels disagree on rows without keys (flash-attn reports +inf); normalise to out 0, lse -inf.
    empty = ~torch.isfinite(lse)
    if empty.any():
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0)
    return out, lse


def _segment_ids(starts, ends, length, device):
    ids = torch.full((length,), -1, dtype=torch.int32)
    for i, (a, e) in enumerate(zip(starts, ends)):
        ids[a:e] = i
    return ids.to(device)


def _flex_packed(q, k, v, scale, segments):
    doc_q = _segment_ids(segments.q_starts, segments.q_ends, q.shape[1], q.device)
    doc_kv = _segment_ids(segments.kv_starts, segments.kv_ends, k.shape[1], q.device)

    def document_mask(b, h, q_idx, kv_idx):
        return (doc_q[q_idx] == doc_kv[kv_idx]) & (doc_q[q_idx] >= 0)

    return _flex(q, k, v, scale, (document_mask, q.shape[1], k.shape[1]))


def _flash_attn_dense(q, k, v, scale):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=False, return_attn_probs=True)
    return _zero_empty_rows(out, lse.float())


def _flash_attn_packed(q, k, v, scale, segments):
    """Varlen flash-attn on the real tokens only (padding between samples is gathered out)."""
    from flash_attn import flash_attn_varlen_func

    segs = segments.nonempty()
    b, s_q, h, d = q.shape
    out = q.new_zeros(b, s_q, h, d)
    lse = torch.full((b, h, s_q), float("-inf"), dtype=torch.float32, device=q.device)
    if not segs:
        return out, lse
    idx_q = torch.cat([torch.arange(a, e) for a, e, _, _ in segs]).to(q.device)
    idx_kv = torch.cat([torch.arange(c, f) for _, _, c, f in segs]).to(q.device)
    cu_q = torch.tensor([0] + [e - a for a, e, _, _ in segs], device=q.device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [f - c for _, _, c, f in segs], device=q.device).cumsum(0).to(torch.int32)
    o, l, _ = flash_attn_varlen_func(
        q[0, idx_q], k[0, idx_kv], v[0, idx_kv], cu_q, cu_k,
        max(e - a for a, e, _, _ in segs), max(f - c for _, _, c, f in segs),
        softmax_scale=scale, causal=False, return_attn_probs=True)
    out[0, idx_q] = o
    lse[0][:, idx_q] = l.float()  # flash-attn >= 2.4 returns the unpadded [h, total_q] layout
    return out, lse


_DENSE = {"math64": _math64_dense, "flash_cpu": _flash_cpu_dense, "sdpa": _sdpa_dense,
          "flex": _flex_dense, "flash_attn": _flash_attn_dense}


# --------------------------------------------------------------------------------------------
# backward


def attention_backward(dout, q, k, v, out, lse, *, segments: Segments | None = None, softmax_scale=None,
                       dlse=None):
    """Gradients ``(dq, dk, dv)`` in float32 (float64 for float64 inputs) from the saved forward.

    ``out``/``lse`` may be the *merged* result of several key blocks (a ring): the softmax
    probabilities are ``exp(s - lse)`` against the global lse, so summing this over blocks gives
    the exact gradient. ``dlse`` (``[b,h,s_q]``) is the gradient flowing into lse itself:
    since ``d lse / d s = p`` it enters as ``ds = p * (dp - (rowsum(dout*out) - dlse))``.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    # delta = rowsum(dout * out) - dlse, shape [b, s_q, h]
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(dtype).transpose(1, 2)
    blocks = [(0, q.shape[1], 0, k.shape[1])] if segments is None else segments.nonempty()
    with torch.no_grad():
        for a, e, c, f in blocks:
            _math_backward_block(dout[:, a:e], q[:, a:e], k[:, c:f], v[:, c:f], lse[:, :, a:e],
                                 delta[:, a:e], scale, dtype, dq[:, a:e], dk[:, c:f], dv[:, c:f])
    return dq, dk, dv


def _math_backward_block(dout, q, k, v, lse, delta, scale, dtype, dq, dk, dv):
    b, s_q, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    qg = q.to(dtype).reshape(b, s_q, hk, g, d)
    dog = dout.to(dtype).reshape(b, s_q, hk, g, d)
    lse_g = lse.to(dtype).reshape(b, hk, g, s_q)
    delta_g = delta.reshape(b, s_q, hk, g).permute(0, 2, 3, 1)
    kd, vd = k.to(dtype), v.to(dtype)
    dq_g = dq.view(b, s_q, hk, g, d)
    for lo, hi in _head_chunks(b * g * s_q * k.shape[1], hk):
        sl = slice(lo, hi)
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg[:, :, sl], kd[:, :, sl]) * scale
        p = torch.exp(s - lse_g[:, sl].unsqueeze(-1))
        dp = torch.einsum("bqhgd,bkhd->bhgqk", dog[:, :, sl], vd[:, :, sl])
        ds = p * (dp - delta_g[:, sl].unsqueeze(-1))
        dq_g[:, :, sl] += torch.einsum("bhgqk,bkhd->bqhgd", ds, kd[:, :, sl]) * scale
        dk[:, :, sl] += torch.einsum("bhgqk,bqhgd->bkhd", ds, qg[:, :, sl]) * scale
        dv[:, :, sl] += torch.einsum("bhgqk,bqhgd->bkhd", p, dog[:, :, sl])


# --------------------------------------------------------------------------------------------
# autograd op


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, scale, backend):
        out, lse = attention_forward(q, k, v, segments=segments, softmax_scale=scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.scale = segments, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, segments=ctx.segments,
                                        softmax_scale=ctx.scale, dlse=dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def segment_attention(q, k, v, *, segments: Segments | None = None, softmax_scale=None, backend="auto"):
    """Differentiable ``(out, lse)`` for a :class:`Segments` pattern (the form the CP ops use)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    _check_shapes(q, k, v, segments)
    return _LocalAttention.apply(q, k, v, segments, scale, backend)


def local_attention(q, k, v, *, cu_seqlens_q=None, cu_seqlens_kv=None, softmax_scale=None,
                    backend="auto", return_lse=False):
    """Non-causal attention on one device.

    q ``[b, s_q, h, d]``, k/v ``[b, s_kv, h_kv, d]`` (``h % h_kv == 0``, GQA). With
    ``cu_seqlens_q``/``cu_seqlens_kv`` (int32 ``[n+1]``, packed THD, b must be 1) attention is
    block-diagonal: query segment ``i`` attends only to key segment ``i``; tokens past
    ``cu_seqlens[-1]`` are padding (output 0, grads 0). Passing only one of the two uses it for
    both. Returns ``out [b, s_q, h, d]`` (dtype of q) and, if ``return_lse``, lse float32
    ``[b, h, s_q]`` (``-inf`` on rows with no key); both are differentiable.

    Backends: ``"sdpa"``, ``"flash_cpu"``, ``"flex"``, ``"flash_attn"`` (CUDA), ``"math64"``
    (float64 reference), ``"auto"`` (flash-attn on GPU if installed and half precision, else
    SDPA on GPU, flash_cpu on CPU). The forward runs on the backend; the backward is exact fp32
    math (:func:`attention_backward`, float64 for float64 inputs).
    """
    segments = None
    if cu_seqlens_q is not None or cu_seqlens_kv is not None:
        cu_q = cu_seqlens_q if cu_seqlens_q is not None else cu_seqlens_kv
        segments = Segments.from_cu_seqlens(cu_q, cu_seqlens_kv if cu_seqlens_kv is not None else cu_q)
    out, lse = segment_attention(q, k, v, segments=segments, softmax_scale=softmax_scale, backend=backend)
    return (out, lse) if return_lse else out
