"""Packed (segment) attention as one operator that compiled graphs hold without a break.

A packing is host ints that change with every micro-batch (:class:`~kernels.segments.Segments`).
Traced, each new packing would recompile the graph that reads them; called outside the graphs, the
attention breaks every compiled layer into pieces, and a break inside megatron's attention (its
activation-offloading context) leaves the rest of megatron's function to run eagerly. On an H100
the host then took about as long as the device to queue a MovieGen-3B micro-batch (~12 ms per
layer), and the device waited for it; on the CPU a llama-tiny layer's host time was 1.4 ms in one
graph against 5-7.5 ms in pieces.

Here the packing travels as a *plan*: a 0-dim int64 host tensor naming the ``Segments`` in a
registry (:func:`plan`). A tensor is a graph input like any other (no guard on its value, so no
recompile), and the operator (``torch.library.custom_op``) looks the pattern up when it runs, on
the kernels of :func:`kernels.local_attention.attention_forward` / ``attention_backward``.

A plan must outlive its backward: the trainer forgets the plans at the start of each step
(:func:`forget_plans`; a step's backward passes are all done by then, also under pipeline
parallelism and full recompute), and the registry keeps at most :data:`KEEP` plans for other
callers. A pattern's device-side plans (``Segments.varlen``) live as long as its plan.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from .attention_kernels import softmax_scale_or_default
from .local_attention import attention_backward, attention_forward
from .segments import Segments

KEEP = 4096
"""Plans kept at most (a text model makes two per micro-batch): a plan's backward must run before
:data:`KEEP` newer plans are made or :func:`forget_plans` is called."""

_PLANS: "OrderedDict[int, Segments]" = OrderedDict()
_KEYS = itertools.count()


def plan(segments: Segments) -> torch.Tensor:
    """A plan naming ``segments`` for :func:`planned_attention`: a 0-dim int64 host tensor (build it
    once per micro-batch, outside compiled code, and pass it to every layer)."""
    if torch.compiler.is_compiling():  # traced, the key would be a constant of the graph: every call its packing
        raise RuntimeError("kernels.planned_attention.plan must be called outside compiled code (once per "
                           "micro-batch), and the plan passed in")
    key = next(_KEYS)
    _PLANS[key] = segments
    while len(_PLANS) > KEEP:
        _PLANS.popitem(last=False)
    return torch.tensor(key, dtype=torch.int64)


def forget_plans() -> None:
    """Drop every plan (and the device tensors of their patterns): once no backward is pending."""
    _PLANS.clear()


def segments_of(plan_id: torch.Tensor) -> Segments:
    """The ``Segments`` a plan names."""
    segments = _PLANS.get(int(plan_id))
    if segments is None:
        raise RuntimeError(f"attention plan {int(plan_id)} is no longer kept: its backward ran after forget_plans() "
                           f"or after {KEEP} newer plans; raise kernels.planned_attention.KEEP")
    return segments


# cudagraph_unsafe: a graph captured around it would replay the first packing's host ints
@torch.library.custom_op("dit_kernels::planned_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_id: torch.Tensor, scale: float,
             backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = attention_forward(q, k, v, segments=segments_of(plan_id), softmax_scale=scale, backend=backend)
    return out.contiguous(), lse.contiguous()  # the layouts the fake below tells the compiler


@_forward.register_fake
def _(q, k, v, plan_id, scale, backend):
    b, s, h = q.shape[:3]
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("dit_kernels::planned_attention_backward", mutates_args=(),
                         tags=(torch.Tag.cudagraph_unsafe,))
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, plan_id: torch.Tensor, scale: float,
              backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = attention_backward(dout.contiguous(), q, k, v, out, lse, segments=segments_of(plan_id),
                                    softmax_scale=scale, backend=backend)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_backward.register_fake
def _(dout, q, k, v, out, lse, plan_id, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, plan_id, scale, backend = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # the fused backward takes no gradient on it
    ctx.save_for_backward(q, k, v, out, lse, plan_id)
    ctx.scale, ctx.backend = scale, backend


def _gradients(ctx, dout, dlse):
    q, k, v, out, lse, plan_id = ctx.saved_tensors
    dq, dk, dv = _backward(dout, q, k, v, out, lse, plan_id, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None


_forward.register_autograd(_gradients, setup_context=_setup_context)


def planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_id: torch.Tensor, *,
                      softmax_scale=None, backend: str = "auto") -> torch.Tensor:
    """Differentiable ``out [b, s_q, h, d]`` of :func:`kernels.local_attention.segment_attention`
    (``return_lse=False``) for the packing ``plan_id`` names (:func:`plan`), as one operator: inside
    ``torch.compile`` it is a node of the graph, not a break."""
    return _forward(q, k, v, plan_id, softmax_scale_or_default(softmax_scale, q), backend)[0]
