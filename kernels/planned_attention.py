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

Context-parallel attention runs as the same operator (``method`` ``"p2p"``, the ring, or
``"all_gather"``) on a process group named by a constant key (:func:`group_key`); Ulysses and USP
put their all-to-alls in the graph as functional collectives around it
(:func:`kernels.context_parallel.planned_context_parallel_attention`). Dense input (no packing) is
the plan :data:`NO_SEGMENTS`.

A plan must outlive its backward: the trainer forgets the plans at the start of each step
(:func:`forget_plans`; a step's backward passes are all done by then, also under pipeline
parallelism and full recompute), and the registry keeps at most :data:`KEEP` plans for other
callers. A pattern's device-side plans (``Segments.varlen``) live as long as its plan.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from .all_gather import all_gather_backward, all_gather_forward
from .attention_kernels import softmax_scale_or_default
from .local_attention import attention_backward, attention_forward
from .ring import ring_backward, ring_forward
from .segments import Segments

KEEP = 4096
"""Plans kept at most (a text model makes two per micro-batch): a plan's backward must run before
:data:`KEEP` newer plans are made or :func:`forget_plans` is called."""

_PLANS: "OrderedDict[int, Segments]" = OrderedDict()
_KEYS = itertools.count()
_NONE = -1
NO_SEGMENTS = torch.tensor(_NONE, dtype=torch.int64)
"""The plan of dense input: every query attends to every key."""

METHODS = ("local", "p2p", "all_gather")
"""``local``: one device; ``p2p``: the ring over a context-parallel group; ``all_gather``: K/V gathered
from it (:mod:`kernels.ring`, :mod:`kernels.all_gather`)."""
_CP = {"p2p": (ring_forward, ring_backward), "all_gather": (all_gather_forward, all_gather_backward)}
_GROUPS: list = []


def group_key(group) -> int:
    """A constant naming ``group`` for the operator: the same for every layer on the same group, so
    the layers share one compiled graph. Call it outside compiled code (when a layer is built). The
    registry only grows (by the process groups a process makes, a handful); :func:`release_groups`
    empties its entries when the groups are destroyed."""
    for key, known in enumerate(_GROUPS):
        if known is group:
            return key
    _GROUPS.append(group)
    return len(_GROUPS) - 1


def release_groups() -> None:
    """Forget every registered group (they are being destroyed), so none outlives its layout. The keys
    stay taken: a graph compiled for a released group never runs on a group registered later."""
    _GROUPS[:] = [None] * len(_GROUPS)


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


def segments_of(plan_id: torch.Tensor) -> Segments | None:
    """The ``Segments`` a plan names (None: :data:`NO_SEGMENTS`)."""
    if int(plan_id) == _NONE:
        return None
    segments = _PLANS.get(int(plan_id))
    if segments is None:
        raise RuntimeError(f"attention plan {int(plan_id)} is no longer kept: its backward ran after forget_plans() "
                           f"or after {KEEP} newer plans; raise kernels.planned_attention.KEEP")
    return segments


def _run_forward(q, k, v, plan_id, scale, backend, method, group):
    if method == "local":
        return attention_forward(q, k, v, segments=segments_of(plan_id), softmax_scale=scale, backend=backend)
    return _CP[method][0](q, k, v, segments=segments_of(plan_id), scale=scale, backend=backend, group=_GROUPS[group])


def _run_backward(dout, q, k, v, out, lse, plan_id, scale, backend, method, group):
    if method == "local":
        return attention_backward(dout, q, k, v, out, lse, segments=segments_of(plan_id), softmax_scale=scale,
                                  backend=backend)
    return _CP[method][1](dout, q, k, v, out, lse, segments=segments_of(plan_id), scale=scale, backend=backend,
                          group=_GROUPS[group])


def _owned(outputs, inputs) -> tuple:
    """The outputs contiguous (the layouts the fakes tell the compiler), each in memory of its own: a
    custom operator's outputs may not alias its inputs or one another (the ring's dK and dV are
    halves of one buffer)."""
    taken = {t.untyped_storage().data_ptr() for t in inputs}
    owned = []
    for t in outputs:
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in taken:
            t = t.clone()
        taken.add(t.untyped_storage().data_ptr())
        owned.append(t)
    return tuple(owned)


# cudagraph_unsafe: a graph captured around it would replay the first packing's host ints
@torch.library.custom_op("dit_kernels::planned_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_id: torch.Tensor, scale: float,
             backend: str, method: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _owned(_run_forward(q, k, v, plan_id, scale, backend, method, group), (q, k, v))


@_forward.register_fake
def _(q, k, v, plan_id, scale, backend, method, group):
    b, s, h = q.shape[:3]
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("dit_kernels::planned_attention_backward", mutates_args=(),
                         tags=(torch.Tag.cudagraph_unsafe,))
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, plan_id: torch.Tensor, scale: float, backend: str, method: str,
              group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _owned(_run_backward(dout.contiguous(), q, k, v, out, lse, plan_id, scale, backend, method, group),
                  (dout, q, k, v, out, lse))


@_backward.register_fake
def _(dout, q, k, v, out, lse, plan_id, scale, backend, method, group):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, plan_id, *ctx.constants = inputs  # scale, backend, method, group
    out, lse = output
    ctx.mark_non_differentiable(lse)  # the fused backward takes no gradient on it
    ctx.save_for_backward(q, k, v, out, lse, plan_id)


def _gradients(ctx, dout, dlse):
    dq, dk, dv = _backward(dout, *ctx.saved_tensors, *ctx.constants)
    return dq, dk, dv, None, None, None, None, None


_forward.register_autograd(_gradients, setup_context=_setup_context)


def planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_id: torch.Tensor, *,
                      softmax_scale=None, backend: str = "auto", method: str = "local",
                      group: int | None = None) -> torch.Tensor:
    """Differentiable ``out [b, s_q, h, d]`` of :func:`kernels.local_attention.segment_attention`
    (``return_lse=False``) for the packing ``plan_id`` names (:func:`plan`), as one operator: inside
    ``torch.compile`` it is a node of the graph, not a break. ``method`` ``"p2p"`` / ``"all_gather"``:
    the context-parallel attention of this rank's contiguous shard over the group ``group`` names
    (:func:`group_key`), the plan's segments in global coordinates (as
    :func:`kernels.context_parallel.context_parallel_attention`)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; choose one of {METHODS}")
    if (method == "local") != (group is None):
        raise ValueError(f"method={method!r} " + ("takes no group" if group is not None else
                                                  "needs group=kernels.planned_attention.group_key(cp_group)"))
    return _forward(q, k, v, plan_id, softmax_scale_or_default(softmax_scale, q), backend, method,
                    -1 if group is None else group)[0]
