"""Single-device (non-causal) attention, dense or packed, with the log-sum-exp every ring needs.

Layout everywhere in ``kernels``: q ``[b, s_q, h, d]``, k/v ``[b, s_kv, h_kv, d]`` with
``h % h_kv == 0`` (GQA: query head ``j`` reads kv head ``j // (h // h_kv)``), lse float32
``[b, h, s_q]``.

Packed input is described by :class:`~kernels.segments.Segments`. Tokens in no segment are
padding: their output is 0, their lse is ``-inf`` and they get no gradient. Segments may be
empty, which is what a context-parallel shard sees when a sample lies on another rank; a query
row with no key gets out 0 and lse ``-inf`` and merges safely.

The parallel ops are built on two primitives, as flash-attention is: :func:`attention_forward`
returns ``(out, lse)`` and :func:`attention_backward` takes them back; both run on the fused
kernels of :mod:`kernels.attention_kernels` and record no autograd graph.
:func:`segment_attention` / :func:`local_attention` wrap them into one autograd op.

Packed input runs without a Python loop over samples where the layout allows: a pack whose
segments form one run of equal, evenly strided samples (same-size images; the dense case) is a
single batched call on a strided view; on GPU, varlen kernels take any mix of lengths in one
call; otherwise each run of equal consecutive samples is one batched call.
"""
from __future__ import annotations

import torch

from .attention_kernels import BACKENDS  # noqa: F401  (kept importable from here, where it used to live)
from .attention_kernels import KERNELS, Kernel, lse_grad_kernel, resolve_backend, softmax_scale_or_default
from .segments import Segments


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
# dense calls: empty inputs and GQA for kernels that need equal heads


def _expand_kv(kernel: Kernel, q, k, v, head_dim: int):
    """k, v with as many heads as q when the kernel needs equal heads (GQA by repetition)."""
    groups = 1 if kernel.gqa else q.shape[head_dim] // k.shape[head_dim]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=head_dim), v.repeat_interleave(groups, dim=head_dim)


def _sum_heads(x, kv_heads, head_dim):
    """Sum the gradient of repeated kv heads back over each group."""
    return x if x.shape[head_dim] == kv_heads else torch.unflatten(x, head_dim, (kv_heads, -1)).sum(head_dim + 1)


def _empty_result(q):
    out = q.new_zeros(q.shape)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _dense_forward(kernel: Kernel, q, k, v, scale):
    if q.numel() == 0 or k.shape[1] == 0:  # kernels reject empty inputs; no key -> out 0, lse -inf
        return _empty_result(q)
    return kernel.forward(q, *_expand_kv(kernel, q, k, v, 2), scale)


def _dense_backward(kernel: Kernel, dout, q, k, v, out, lse, scale, dlse=None):
    if q.numel() == 0 or k.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    extra = {} if dlse is None else {"dlse": dlse}
    dq, dk, dv = kernel.backward(dout, q, *_expand_kv(kernel, q, k, v, 2), out, lse, scale, **extra)
    return dq, _sum_heads(dk, k.shape[2], 2), _sum_heads(dv, k.shape[2], 2)


def _varlen_forward(kernel: Kernel, q, k, v, vl, scale):
    return kernel.varlen_forward(q, *_expand_kv(kernel, q, k, v, 1), vl, scale)


def _varlen_backward(kernel: Kernel, dout, q, k, v, out, lse, vl, scale):
    dq, dk, dv = kernel.varlen_backward(dout, q, *_expand_kv(kernel, q, k, v, 1), out, lse, vl, scale)
    return dq, _sum_heads(dk, k.shape[1], 1), _sum_heads(dv, k.shape[1], 1)


# --------------------------------------------------------------------------------------------
# forward


def attention_forward(q, k, v, *, segments: Segments | None = None, softmax_scale=None, backend="auto"):
    """``(out [b,s_q,h,d] in q's dtype, lse float32 [b,h,s_q])`` on ``backend``'s fused kernel.

    No autograd graph is recorded: this is the primitive the autograd ops are built from.
    """
    _check_shapes(q, k, v, segments)
    kernel = KERNELS[resolve_backend(backend, q, segments, k)]
    scale = softmax_scale_or_default(softmax_scale, q)
    with torch.no_grad():
        if segments is None:
            return _dense_forward(kernel, q, k, v, scale)
        return _packed_forward(kernel, q, k, v, segments, scale)


def _uses_varlen(kernel: Kernel, runs) -> bool:
    return kernel.varlen_forward is not None and len(runs) > 1


def _packed_forward(kernel, q, k, v, segments, scale):
    runs = segments.runs
    if len(runs) == 1 and runs[0].covers(q.shape[1], k.shape[1]):  # reshape, nothing to pad
        run = runs[0]
        out, lse = _dense_forward(kernel, run.q_view(q), run.k_view(k), run.k_view(v), scale)
        return out.reshape(q.shape), lse.transpose(0, 1).reshape(1, q.shape[2], q.shape[1])
    out, lse = _empty_result(q)
    if _uses_varlen(kernel, runs):
        vl = segments.varlen(q.device)
        o, l = _varlen_forward(kernel, vl.pack_q(q), vl.pack_k(k), vl.pack_k(v), vl, scale)
        vl.unpack_q(out, o)
        vl.unpack_q(lse.transpose(1, 2), l.t(), pad_value=float("-inf"))
        return out, lse
    for run in runs:
        o, l = _dense_forward(kernel, run.q_view(q), run.k_view(k), run.k_view(v), scale)
        run.q_view(out).copy_(o)
        run.lse_view(lse).copy_(l)
    return out, lse


# --------------------------------------------------------------------------------------------
# backward


def attention_backward(dout, q, k, v, out, lse, *, segments: Segments | None = None, softmax_scale=None,
                       dlse=None, backend="auto"):
    """Gradients ``(dq, dk, dv)`` (dtypes of q, k, v) from the saved forward, on fused kernels.

    ``out``/``lse`` may be the *merged* result of several key blocks (a ring): the kernels
    recompute the probabilities as ``exp(s - lse)`` against the given lse and ``delta`` from the
    given out, so summing this over blocks gives the exact gradient. ``dlse`` (``[b,h,s_q]``) is
    a gradient flowing into lse itself; no fused kernel takes one, so only then the float math
    backward runs instead.
    """
    name = resolve_backend(backend, q, segments, k)
    kernel = KERNELS[name] if dlse is None else lse_grad_kernel(name)
    scale = softmax_scale_or_default(softmax_scale, q)
    with torch.no_grad():
        if segments is None:
            return _dense_backward(kernel, dout, q, k, v, out, lse, scale, dlse)
        return _packed_backward(kernel, dout, q, k, v, out, lse, segments, scale, dlse)


def _packed_backward(kernel, dout, q, k, v, out, lse, segments, scale, dlse):
    runs = segments.runs
    if len(runs) == 1 and runs[0].covers(q.shape[1], k.shape[1]):
        run = runs[0]
        grads = _run_backward(kernel, run, dout, q, k, v, out, lse, scale, dlse)
        return tuple(g.reshape(t.shape) for g, t in zip(grads, (q, k, v)))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if _uses_varlen(kernel, runs):  # never with dlse: the math kernel has no varlen form
        vl = segments.varlen(q.device)
        g = _varlen_backward(kernel, vl.pack_q(dout), vl.pack_q(q), vl.pack_k(k), vl.pack_k(v), vl.pack_q(out),
                             vl.pack_lse(lse), vl, scale)
        vl.unpack_q(dq, g[0])
        vl.add_k(dk, g[1])
        vl.add_k(dv, g[2])
        return dq, dk, dv
    for run in runs:
        gq, gk, gv = _run_backward(kernel, run, dout, q, k, v, out, lse, scale, dlse)
        run.q_view(dq).add_(gq)  # add: key ranges of different runs may overlap (shared keys)
        run.k_view(dk).add_(gk)
        run.k_view(dv).add_(gv)
    return dq, dk, dv


def _run_backward(kernel, run, dout, q, k, v, out, lse, scale, dlse):
    return _dense_backward(kernel, run.q_view(dout), run.q_view(q), run.k_view(k), run.k_view(v), run.q_view(out),
                           run.lse_view(lse), scale, None if dlse is None else run.lse_view(dlse))


# --------------------------------------------------------------------------------------------
# autograd op


class _LocalAttention(torch.autograd.Function):
    """``out`` (and ``lse`` with ``with_lse``). Callers that do not differentiate through lse ask
    for ``out`` alone: a gradient on lse needs the slower math backward, and compiled autograd
    hands an unused output's gradient over as zeros (``set_materialize_grads`` is eager-only)."""

    @staticmethod
    def forward(ctx, q, k, v, segments, scale, backend, with_lse):
        ctx.set_materialize_grads(False)  # eager: an unused lse arrives as dlse=None, not zeros
        out, lse = attention_forward(q, k, v, segments=segments, softmax_scale=scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.scale, ctx.backend = segments, scale, backend
        return (out, lse) if with_lse else out

    @staticmethod
    def backward(ctx, dout, dlse=None):
        if dout is None and dlse is None:
            return None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, segments=ctx.segments, softmax_scale=ctx.scale,
                                        dlse=dlse, backend=ctx.backend)
        return dq, dk, dv, None, None, None, None


def segment_attention(q, k, v, *, segments: Segments | None = None, softmax_scale=None, backend="auto",
                      return_lse: bool = True):
    """Differentiable ``(out, lse)`` for a :class:`Segments` pattern (the form the CP ops use), or
    ``out`` alone with ``return_lse=False`` (faster backward when lse is not needed).

    Build ``segments`` once per micro-batch and pass the same object to every layer: the kernel
    plans are cached on it.
    """
    scale = softmax_scale_or_default(softmax_scale, q)
    _check_shapes(q, k, v, segments)
    return _LocalAttention.apply(q, k, v, segments, scale, resolve_backend(backend, q, segments, k), return_lse)


def local_attention(q, k, v, *, cu_seqlens_q=None, cu_seqlens_kv=None, softmax_scale=None,
                    backend="auto", return_lse=False):
    """Non-causal attention on one device.

    q ``[b, s_q, h, d]``, k/v ``[b, s_kv, h_kv, d]`` (``h % h_kv == 0``, GQA). With
    ``cu_seqlens_q``/``cu_seqlens_kv`` (int32 ``[n+1]``, packed THD, b must be 1) attention is
    block-diagonal: query segment ``i`` attends only to key segment ``i``; tokens past
    ``cu_seqlens[-1]`` are padding (output 0, grads 0). Passing only one of the two uses it for
    both. Returns ``out [b, s_q, h, d]`` (dtype of q) and, if ``return_lse``, lse float32
    ``[b, h, s_q]`` (``-inf`` on rows with no key); both are differentiable.

    Backends (:data:`kernels.attention_kernels.BACKENDS`): ``"flash_cpu"`` (CPU),
    ``"sdpa_flash"`` / ``"sdpa_efficient"`` / ``"sdpa_cudnn"`` (torch's CUDA kernels),
    ``"flash_attn"`` (the flash-attn package), ``"sdpa"`` (torch's best for the device),
    ``"math64"`` (float64 reference) and ``"auto"`` (the fastest available). Forward and
    backward both run on the chosen kernel.
    """
    segments = None
    if cu_seqlens_q is not None or cu_seqlens_kv is not None:
        cu_q = cu_seqlens_q if cu_seqlens_q is not None else cu_seqlens_kv
        segments = Segments.from_cu_seqlens(cu_q, cu_seqlens_kv if cu_seqlens_kv is not None else cu_q)
    return segment_attention(q, k, v, segments=segments, softmax_scale=softmax_scale, backend=backend,
                             return_lse=return_lse)
