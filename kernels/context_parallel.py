"""Context-parallel attention: one entry point over ring, Ulysses, all-gather and USP.

Layout contract (all methods):

* q/k/v are each rank's contiguous local shard ``[b, s_local, h, d]``; the full sequence is the
  concatenation of the shards in the rank order of ``cp_group``. Attention is non-causal, so
  contiguous shards are already load-balanced (no zig-zag reordering).
* Packed input (``b == 1``) passes the **global** ``cu_seqlens`` of the full packed sequence
  (int32 ``[n+1]``, identical on every rank). With ``cu_seqlens_padded`` (TransformerEngine's
  convention, produced by :func:`kernels.packing.split_packed_for_cp`) sample ``i`` occupies
  ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`` with its ``cu_seqlens[i+1]-cu_seqlens[i]``
  real tokens first; without it, sample ``i`` is ``[cu_seqlens[i], cu_seqlens[i+1])``. Tokens in
  no sample (per-sample and tail padding) are never attended to: their output is 0, their lse
  ``-inf`` and their gradients exactly 0.
* Returns this rank's ``out [b, s_local, h, d]`` and, with ``return_lse``, its lse float32
  ``[b, h, s_local]`` (differentiable).
"""
from __future__ import annotations

import math

import torch.distributed as dist

from .all_gather import all_gather_attention
from .local_attention import Segments, local_attention, segment_attention
from .planned_attention import planned_attention
from .ring import ring_attention
from .ulysses import check_heads, heads_to_sequence, sequence_to_heads, ulysses_attention

CP_METHODS = ("p2p", "a2a", "all_gather", "a2a+p2p")


def context_parallel_attention(q, k, v, *, method, cp_group, cu_seqlens=None, return_lse=False,
                               a2a_group=None, p2p_group=None, softmax_scale=None, backend="auto",
                               cu_seqlens_padded=None, segments=None):
    """Non-causal attention of a sequence sharded contiguously over ``cp_group`` (see module doc).

    ``method``: ``"p2p"`` (ring), ``"a2a"`` (Ulysses), ``"all_gather"`` (gather K/V), or
    ``"a2a+p2p"`` (USP: Ulysses over ``a2a_group`` inside a ring over ``p2p_group``; build them
    with :func:`build_hybrid_groups`). ``backend`` picks the local kernel (see
    :func:`kernels.local_attention.local_attention`). ``segments``: the packed pattern as a
    prebuilt :class:`Segments` in global coordinates, instead of ``cu_seqlens`` (callers that run
    many layers on one batch build it once; its kernel plans are cached on it).
    """
    _validate(q, k, v, method, cp_group, a2a_group, p2p_group)
    degree = dist.get_world_size(cp_group)
    b, s_local, h, d = q.shape
    if segments is None:
        segments = _global_segments(cu_seqlens, cu_seqlens_padded, b, s_local * degree)
    elif cu_seqlens is not None or cu_seqlens_padded is not None:
        raise ValueError("pass the packed pattern once: either segments or cu_seqlens(_padded)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if degree == 1:
        out, lse = segment_attention(q, k, v, segments=segments, softmax_scale=scale, backend=backend)
    elif method == "p2p":
        out, lse = ring_attention(q, k, v, group=cp_group, segments=segments, softmax_scale=scale, backend=backend)
    elif method == "all_gather":
        out, lse = all_gather_attention(q, k, v, group=cp_group, segments=segments, softmax_scale=scale,
                                        backend=backend)
    elif method == "a2a":
        return _maybe_lse(ulysses_attention(q, k, v, group=cp_group, segments=segments, softmax_scale=scale,
                                            backend=backend, return_lse=return_lse), return_lse)
    else:
        return _maybe_lse(ulysses_attention(q, k, v, group=a2a_group, ring_group=p2p_group, segments=segments,
                                            softmax_scale=scale, backend=backend, return_lse=return_lse),
                          return_lse)
    return _maybe_lse((out, lse), return_lse)


def planned_context_parallel_attention(q, k, v, plan_id, *, method, cp_group, group_keys: dict, a2a_group=None,
                                       p2p_group=None, softmax_scale=None, backend="auto"):
    """:func:`context_parallel_attention`'s ``out`` as operators that compiled graphs hold without a
    break (:mod:`kernels.planned_attention`): the packing is a plan (``plan_id``; dense input:
    ``planned_attention.NO_SEGMENTS``), the ring and the all-gather are the planned operator on a group
    key (``group_keys``: ``planned_attention.group_key`` of each group passed, by argument name), and
    Ulysses' all-to-alls are functional collectives traced into the graph
    (:func:`kernels.collectives.all_to_all`)."""
    _validate(q, k, v, method, cp_group, a2a_group, p2p_group)
    kw = dict(softmax_scale=softmax_scale, backend=backend)
    if method in ("p2p", "all_gather"):
        return planned_attention(q, k, v, plan_id, method=method, group=group_keys["cp_group"], **kw)
    usp = method == "a2a+p2p"  # Ulysses over the a2a group, a ring over the p2p group inside it
    a2a = a2a_group if usp else cp_group
    qh, kh, vh = heads_to_sequence(q, k, v, a2a)  # traced: functional all-to-alls
    out = planned_attention(qh, kh, vh, plan_id, method="p2p" if usp else "local",
                            group=group_keys["p2p_group"] if usp else None, **kw)
    return sequence_to_heads(out, None, a2a)[0]


def _validate(q, k, v, method, cp_group, a2a_group, p2p_group):
    if method not in CP_METHODS:
        raise ValueError(f"method={method!r} is unknown; choose one of {CP_METHODS}")
    if cp_group is None:
        raise ValueError("cp_group is required (use dist.group.WORLD or a new_group of the CP ranks)")
    degree = dist.get_world_size(cp_group)
    s_local = q.shape[1]
    if s_local < 1:
        raise ValueError(f"the local shard is empty (s_local={s_local}): the sequence is shorter than the CP "
                         f"degree {degree}; pad the sequence to a multiple of {degree} or lower the degree")
    if k.shape[1] != s_local or v.shape != k.shape:
        raise ValueError(f"q, k, v must hold the same local tokens: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (self-attention; use cross_attention for replicated text K/V)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if method == "a2a+p2p":  # validated even at degree 1 so a bad layout fails on the smallest run too
        _check_hybrid_groups(cp_group, a2a_group, p2p_group, q.shape[2], k.shape[2])


def _maybe_lse(out_lse, return_lse):
    return out_lse if return_lse else out_lse[0]


def _global_segments(cu_seqlens, cu_seqlens_padded, batch, total):
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded needs cu_seqlens (the real cumulative lengths) as well")
        return None
    if batch != 1:
        raise ValueError(f"packed input (cu_seqlens) needs batch size 1, got {batch}")
    segments = Segments.from_cu_seqlens(cu_seqlens, cu_seqlens, cu_seqlens_padded, cu_seqlens_padded)
    end = int((cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)[-1])
    if end > total:
        raise ValueError(f"cu_seqlens end at token {end} but the CP group holds {total} tokens; cu_seqlens must "
                         "be the GLOBAL cumulative lengths of the full packed sequence (<= s_local * cp size)")
    return segments


def _check_hybrid_groups(cp_group, a2a_group, p2p_group, heads, kv_heads):
    if a2a_group is None or p2p_group is None:
        raise ValueError("method='a2a+p2p' needs both a2a_group and p2p_group (build them with "
                         "kernels.build_hybrid_groups); refusing to fall back to a single level")
    cp, inner, outer = (dist.get_world_size(g) for g in (cp_group, a2a_group, p2p_group))
    if inner * outer != cp:
        raise ValueError(f"a2a_group size {inner} x p2p_group size {outer} = {inner * outer} != cp_group size {cp}; "
                         "the two levels must factor the CP degree exactly")
    cp_rank = dist.get_rank(cp_group)
    if dist.get_rank(p2p_group) * inner + dist.get_rank(a2a_group) != cp_rank:
        raise ValueError(f"cp rank {cp_rank} is a2a rank {dist.get_rank(a2a_group)} in p2p position "
                         f"{dist.get_rank(p2p_group)}: the a2a groups must be contiguous runs of cp ranks and the "
                         "p2p groups strided across them (use kernels.build_hybrid_groups)")
    check_heads(heads, kv_heads, inner)


def build_hybrid_groups(cp_ranks, a2a_size: int):
    """Create the USP groups for the cp group with global ranks ``cp_ranks`` (in cp order).

    Inner (a2a) groups are contiguous runs ``cp_ranks[o*U:(o+1)*U]`` (keep them inside a node);
    outer (p2p) groups are the strided sets ``cp_ranks[u::U]``. ``dist.new_group`` is collective,
    so every rank of the default group must call this with the same arguments, even ranks outside
    ``cp_ranks`` (they get ``(None, None)``). Returns this rank's ``(a2a_group, p2p_group)``.
    """
    cp_ranks = list(cp_ranks)
    if a2a_size < 1 or len(cp_ranks) % a2a_size:
        raise ValueError(f"a2a_size {a2a_size} must divide the CP size {len(cp_ranks)}")
    me = dist.get_rank()
    a2a_group = p2p_group = None
    for o in range(len(cp_ranks) // a2a_size):
        ranks = cp_ranks[o * a2a_size:(o + 1) * a2a_size]
        group = dist.new_group(ranks)
        if me in ranks:
            a2a_group = group
    for u in range(a2a_size):
        ranks = cp_ranks[u::a2a_size]
        group = dist.new_group(ranks)
        if me in ranks:
            p2p_group = group
    return a2a_group, p2p_group


def cross_attention(q_local, k_text, v_text, *, cu_seqlens_q_local=None, cu_seqlens_kv=None,
                    cu_seqlens_q_local_padded=None, softmax_scale=None, backend="auto", return_lse=False):
    """Attention of this rank's query shard to replicated (full) text K/V; no communication.

    Packed: ``cu_seqlens_kv`` are the text's cumulative lengths (one entry per sample of the whole
    pack) and ``cu_seqlens_q_local`` (with ``cu_seqlens_q_local_padded`` if the layout has padding)
    this rank's local query pieces with the same number of samples, empty for samples on other
    ranks — :meth:`kernels.packing.CPPackedLayout.local_cu_seqlens` gives exactly that. Each query
    token attends to the text of its own sample.
    """
    if cu_seqlens_q_local is None and cu_seqlens_kv is None:
        return local_attention(q_local, k_text, v_text, softmax_scale=softmax_scale, backend=backend,
                               return_lse=return_lse)
    if cu_seqlens_q_local is None or cu_seqlens_kv is None:
        raise ValueError("packed cross_attention needs both cu_seqlens_q_local and cu_seqlens_kv")
    segments = Segments.from_cu_seqlens(cu_seqlens_q_local, cu_seqlens_kv, cu_seqlens_q_local_padded, None)
    out, lse = segment_attention(q_local, k_text, v_text, segments=segments, softmax_scale=softmax_scale,
                                 backend=backend)
    return (out, lse) if return_lse else out

