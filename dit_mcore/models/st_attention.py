"""Spatial and temporal self-attention of the ST-DiT, as a megatron core attention.

A video sample of ``T`` frames x ``S = H*W`` positions is ``T*S`` tokens, frame-major. Spatial
attention runs within each frame, temporal attention within each position (across frames): both
are batches of short independent sequences.

- One rank (any TP/SP/PP layout): spatial attention is the block-diagonal pattern of the frames
  (``Segments``, one strided run per sample); temporal attention gathers the tokens position-major,
  attends over blocks of ``T`` and scatters back. Dense rows and packed streams of mixed grids
  (images are one frame) take the same path.
- Context parallel (dense batches): each CP rank holds a block of whole frames (the token stream is
  cut into contiguous pieces, so ``T`` must divide by the CP size). Spatial attention is then
  local; temporal attention switches the sharded dim from frames to positions and back
  (``kernels.spatial_temporal``, DSP's dynamic switch): two all-to-alls per spatial+temporal pair.
  ``model.st_attention="dsp"`` switches the layer's hidden states before the QKV projection and
  the projected output after it (:class:`STSelfAttention`: two hidden-size all-to-alls, DSP's
  volume); ``"dsp_overlap"`` cuts both into two pipelined all-to-alls that overlap the
  projections and attention. Under sequence parallel the TP ranks hold different tokens of a CP
  piece, so the switch happens inside the core attention on q|k|v and the output instead (the
  Ulysses volume, ``(2 + 2 h_kv/h)`` hidden sizes).
- Two-level mesh (``model.st_attention="mesh"``, dense): frames over the outer ranks, each frame's
  positions over the inner ranks (the model reorders each row with :func:`mesh_order` before
  cutting it); spatial attention runs Ulysses over the inner group, temporal attention switches
  within the outer group.
- Packed streams under context parallel: each rank holds a contiguous piece of a stream of mixed
  grids, not aligned with frames; its queries attend to keys and values gathered from the CP group
  (spatial: the kernels' all-gather CP attention over the frames; temporal: the gathered stream in
  position-major order, the rank's queries sorted into it).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.transformer.attention import SelfAttention

from dit_mcore.kernels.all_gather import all_gather_attention
from dit_mcore.kernels.attention_kernels import softmax_scale_or_default
from dit_mcore.kernels.collectives import gather_along
from dit_mcore.kernels.host_copy import to_device
from dit_mcore.kernels.local_attention import Segments, segment_attention
from dit_mcore.kernels.planned_attention import group_key, plan, planned_attention
from dit_mcore.kernels.spatial_temporal import KINDS, STLayout, st_qkv_attention
from dit_mcore.kernels.spatial_temporal import st_attention as st_hidden_attention


@dataclass(frozen=True)
class STPattern:
    """Where each sample's frames lie in the token stream one rank's attention sees."""

    starts: tuple[int, ...]
    """Offset of each sample in the stream (dense rows: ``i * tokens_per_row``)."""
    grids: tuple[tuple[int, int], ...]
    """``(T, S)`` of each sample: frames, positions per frame."""
    length: int
    """Tokens in the stream (padding included)."""
    cp_group: Any = None
    """Context parallel: the group whose ranks hold blocks of frames of every (dense) row."""
    query_range: Optional[tuple[int, int]] = None
    """Packed streams under context parallel: ``[start, end)`` of this rank's queries in the whole
    (padded) stream that ``starts`` and ``length`` describe; keys and values are gathered."""
    inner_group: Any = None
    """Two-level mesh (``model.st_attention="mesh"``): the group whose ranks hold blocks of each
    frame's positions (``cp_group`` is then the frames' outer group)."""

    @functools.cached_property
    def geometry(self) -> STPattern:
        """This pattern without its groups: all the cached plans below depend on (caches keyed on the
        groups would keep them, and gloo's threads for each, alive after their layout is gone)."""
        return dataclasses.replace(self, cp_group=None, inner_group=None)

    def layout(self) -> STLayout:
        """The kernels' resident layout of a dense row on this rank (context parallel only)."""
        return STLayout(grid=self.grids[0], group=self.cp_group, sharded="T", inner_group=self.inner_group)


def spatial_segments(pattern: STPattern) -> Segments:
    """One segment per frame of every sample."""
    return _spatial_segments(pattern.geometry)


@functools.lru_cache(maxsize=64)
def _spatial_segments(pattern: STPattern) -> Segments:
    bounds = [(a + f * s, a + (f + 1) * s) for a, (t, s) in zip(pattern.starts, pattern.grids) for f in range(t)]
    starts, ends = tuple(b[0] for b in bounds), tuple(b[1] for b in bounds)
    return Segments(starts, ends, starts, ends)


@functools.lru_cache(maxsize=64)
def _temporal_plan(pattern: STPattern, device: str) -> tuple[torch.Tensor, torch.Tensor, Segments]:
    """``order``: stream index of each token in position-major order (samples keep their place,
    padding stays put), its ``inverse``, both on ``device`` (copied once per pattern), and one
    segment per (sample, position) in that order."""
    order = torch.arange(pattern.length)
    bounds = []
    for a, (t, s) in zip(pattern.starts, pattern.grids):
        order[a:a + t * s] = a + torch.arange(t * s).view(t, s).t().reshape(-1)
        bounds += [(a + p * t, a + (p + 1) * t) for p in range(s)]
    starts, ends = tuple(b[0] for b in bounds), tuple(b[1] for b in bounds)
    return to_device(order, device), to_device(torch.argsort(order), device), Segments(starts, ends, starts, ends)


def temporal_plan(pattern: STPattern, device) -> tuple[torch.Tensor, torch.Tensor, Segments]:
    """``(order, inverse, segments)`` of the temporal attention of ``pattern`` on ``device``."""
    return _temporal_plan(pattern.geometry, str(device))


@functools.lru_cache(maxsize=64)
def _gathered_temporal_plan(pattern: STPattern, device: str):
    """Temporal attention of this rank's queries against the gathered stream: ``(order, sort,
    unsort, segments)`` -- the position-major order of the whole stream, the sort of the local
    queries into that order (and back), and one segment per (sample, position) from the sorted
    local queries to its keys in the reordered stream."""
    start, end = pattern.query_range
    order, inverse, groups = _temporal_plan(pattern, "cpu")
    rank_in_order = inverse[start:end]  # where each local token sits in the position-major stream
    sort = torch.argsort(rank_in_order)
    placed = rank_in_order[sort].tolist()
    q_starts, q_ends = [], []
    for a, e in zip(groups.q_starts, groups.q_ends):  # local queries of each group are consecutive
        q_starts.append(bisect.bisect_left(placed, a))
        q_ends.append(bisect.bisect_left(placed, e))
    segments = Segments(tuple(q_starts), tuple(q_ends), groups.kv_starts, groups.kv_ends)
    return to_device(order, device), to_device(sort, device), to_device(torch.argsort(sort), device), segments


@dataclass(frozen=True, eq=False)
class STPlans:
    """A pattern's spatial and temporal attention as plans (:func:`kernels.planned_attention.plan`)
    and its temporal reorders as device tensors: graph inputs of a compiled layer, not constants, so
    a new packing or grid recompiles nothing and the attention stays inside the layer's graph."""

    spatial: torch.Tensor
    """Plan of the frames' segments."""
    temporal: torch.Tensor
    """Plan of the (sample, position) segments in position-major order."""
    q_order: torch.Tensor
    """The queries in position-major order (one rank: ``order``; packed under CP: the sort of the
    rank's queries into the gathered stream's order)."""
    kv_order: torch.Tensor
    """The keys and values (packed under CP: the gathered stream's) in position-major order."""
    inverse: torch.Tensor
    """The outputs back in stream order."""
    group: Optional[int] = None
    """Packed under CP: :func:`kernels.planned_attention.group_key` of the CP group the keys and
    values are gathered from."""


def st_plans(pattern: STPattern, device) -> Optional[STPlans]:
    """The plans of ``pattern``'s attention on one rank, or of a packed stream under context
    parallel (None for dense video under CP, whose frame/position switches are traced as functional
    all-to-alls). Call it once per micro-batch, outside compiled code, and pass it to every layer."""
    if pattern.query_range is not None:
        order, sort, unsort, segments = _gathered_temporal_plan(pattern.geometry, str(device))
        return STPlans(plan(spatial_segments(pattern)), plan(segments), sort, order, unsort, group_key(pattern.cp_group))
    if pattern.cp_group is not None:
        return None
    order, inverse, segments = temporal_plan(pattern, device)
    return STPlans(plan(spatial_segments(pattern)), plan(segments), order, order, inverse)


def _planned(q, k, v, kind: str, pattern: STPattern, plans: STPlans, **kw) -> torch.Tensor:
    """``[1, n, h, d]`` streams (one rank's, or its piece of a packed stream under CP) through the
    planned operators: the frames' segments (spatial; under CP against the gathered keys), or the
    positions' segments after the position-major reorders (temporal)."""
    if kind == "spatial":
        if plans.group is None:
            return planned_attention(q, k, v, plans.spatial, **kw)
        return planned_attention(q, k, v, plans.spatial, method="all_gather", group=plans.group, **kw)
    if plans.group is not None:
        k, v = (gather_along(x, 1, pattern.cp_group) for x in (k, v))
    q = q.index_select(1, plans.q_order)
    k, v = (x.index_select(1, plans.kv_order) for x in (k, v))
    return planned_attention(q, k, v, plans.temporal, **kw).index_select(1, plans.inverse)


def _gathered(q, k, v, kind: str, pattern: STPattern, softmax_scale=None, backend="auto") -> torch.Tensor:
    """``kind`` attention of this rank's piece ``[1, n, h, d]`` of a packed stream under CP: keys and
    values gathered from the CP group (whose pieces tile the stream in rank order)."""
    scale = softmax_scale_or_default(softmax_scale, q)  # as the planned operator: compiled equals eager
    if kind == "spatial":  # frames are contiguous ranges of the stream: the kernels' all-gather CP
        return all_gather_attention(q, k, v, group=pattern.cp_group, segments=spatial_segments(pattern),
                                    softmax_scale=scale, backend=backend)[0]
    order, sort, unsort, segments = _gathered_temporal_plan(pattern.geometry, str(q.device))
    k, v = (gather_along(x, 1, pattern.cp_group).index_select(1, order) for x in (k, v))
    out = segment_attention(q.index_select(1, sort), k, v, segments=segments, softmax_scale=scale,
                            backend=backend, return_lse=False)
    return out.index_select(1, unsort)


def mesh_order(frames: int, positions: int, outer: int, inner: int) -> torch.Tensor:
    """Token order of a frame-major ``frames x positions`` sample under the two-level mesh: rank
    ``o * inner + u`` holds frame block ``o`` x position block ``u`` (frame-major inside), so cutting
    the reordered stream into equal contiguous pieces gives every CP rank its mesh block."""
    grid = torch.arange(frames * positions).view(outer, frames // outer, inner, positions // inner)
    return grid.permute(0, 2, 1, 3).reshape(-1)


def _one_rank(q, k, v, kind: str, pattern: STPattern, **kw) -> torch.Tensor:
    """``[1, n, h, d]`` streams on one rank: attention over the frames' segments (spatial) or, reordered
    position-major, over the positions' segments (temporal)."""
    if kind == "spatial":
        return segment_attention(q, k, v, segments=spatial_segments(pattern), return_lse=False, **kw)
    order, inverse, segments = temporal_plan(pattern, q.device)
    q, k, v = (x.index_select(1, order) for x in (q, k, v))
    return segment_attention(q, k, v, segments=segments, return_lse=False, **kw).index_select(1, inverse)


@functools.lru_cache(maxsize=64)
def _displaced_plan(kind: str, rows: int, frames: int, positions: int, start: int, end: int, device: str):
    """``(kv_order, q_sort, q_unsort, segments)`` of ``kind`` attention from the tokens ``[start, end)`` of
    each of ``rows`` frame-major rows (``frames x positions`` tokens each) to the whole rows: spatial, one
    segment per (row, frame the range meets) to that frame's keys (no reorder); temporal, the keys
    position-major and the range's queries sorted likewise, one segment per (row, position)."""
    total, span = frames * positions, end - start
    if kind == "spatial":
        bounds = [(i * span + max(f * positions, start) - start, i * span + min((f + 1) * positions, end) - start,
                   i * total + f * positions, i * total + (f + 1) * positions)
                  for i in range(rows) for f in range(start // positions, -(-end // positions))]
        return None, None, None, Segments(*(tuple(b[k] for b in bounds) for k in range(4)))
    by_position = torch.arange(total).view(frames, positions).t().reshape(-1)
    kv_order = torch.cat([i * total + by_position for i in range(rows)])
    index = torch.arange(start, end)
    place = torch.cat([i * total + (index % positions) * frames + index // positions for i in range(rows)])
    sort = torch.argsort(place)
    placed = place[sort].tolist()
    groups = [(i * total + p * frames, i * total + (p + 1) * frames) for i in range(rows) for p in range(positions)]
    segments = Segments(tuple(bisect.bisect_left(placed, a) for a, _ in groups),
                        tuple(bisect.bisect_left(placed, e) for _, e in groups),
                        tuple(a for a, _ in groups), tuple(e for _, e in groups))
    return to_device(kv_order, device), to_device(sort, device), to_device(torch.argsort(sort), device), segments


def displaced_st_attention(query, key, value, *, kind: str, frames: int, positions: int, start: int,
                           softmax_scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """``kind`` attention of the queries ``[e - s, b, h, d]`` of tokens ``[start, start + e - s)`` of every
    dense frame-major row (``frames x positions`` tokens) against the keys and values of the whole rows
    ``[frames * positions, b, h, d]`` (PipeFusion's displaced buffer) -> ``[e - s, b, h*d]``."""
    span, b = query.shape[:2]
    q, k, v = (x.transpose(0, 1).reshape(1, -1, *x.shape[2:]) for x in (query, key, value))
    kv_order, sort, unsort, segments = _displaced_plan(kind, b, frames, positions, start, start + span,
                                                       str(q.device))
    if kind == "temporal":
        q = q.index_select(1, sort)
        k, v = (x.index_select(1, kv_order) for x in (k, v))
    out = segment_attention(q, k, v, segments=segments, softmax_scale=softmax_scale, backend=backend,
                            return_lse=False)
    if kind == "temporal":
        out = out.index_select(1, unsort)
    return out.reshape(b, span, -1).transpose(0, 1)


def st_attention(query, key, value, *, kind: str, pattern: STPattern, softmax_scale: Optional[float] = None,
                 backend: str = "auto", plans: Optional[STPlans] = None) -> torch.Tensor:
    """``kind`` attention of megatron-layout ``[s, b, h, d]`` q/k/v (rows in stream order ``b`` then
    ``s``; packed: ``b = 1``) -> ``[s, b, h*d]``. ``plans`` (:func:`st_plans`): the attention as
    planned operators, which compiled graphs hold without a break."""
    if kind not in KINDS:
        raise ValueError(f"ST attention kind must be one of {KINDS}, got {kind!r}")
    s, b = query.shape[:2]
    q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, h, d]
    kw = dict(softmax_scale=softmax_scale, backend=backend)
    if pattern.cp_group is not None and pattern.query_range is None:  # dense video under CP: switches
        out = st_qkv_attention(q, k, v, kind=kind, layout=pattern.layout(), **kw)
    else:
        q, k, v = (x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v))
        if plans is not None:
            out = _planned(q, k, v, kind, pattern, plans, **kw)
        elif pattern.query_range is not None:
            out = _gathered(q, k, v, kind, pattern, **kw)
        else:
            out = _one_rank(q, k, v, kind, pattern, **kw)
    return out.reshape(b, s, -1).transpose(0, 1)


class STSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` whose context-parallel temporal attention switches hidden states
    (DSP) rather than q|k|v; megatron's own forward (the switch then inside the spatial/temporal core
    attention, :class:`~dit_mcore.models.core_attention.KernelsCoreAttention`) under sequence
    parallel (TP ranks hold different tokens) and with selective recompute of the core attention
    (megatron recomputes exactly that part)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if getattr(config, "attention_output_gate", False):
            raise ValueError("attention_output_gate is not supported by the ST-DiT's attention; set it to False")
        self.hidden_switch = not config.sequence_parallel and not self.checkpoint_core_attention

    def _chunks(self) -> int:
        """Pipelined chunks of the hidden-state switch: ``dsp_overlap``'s two, except in a compiled layer,
        where the all-to-alls are traced collectives waited where they are posted (nothing overlaps)."""
        return 2 if self.config.st_attention == "dsp_overlap" and not torch.compiler.is_compiling() else 1

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        pattern = getattr(packed_seq_params, "st", None)
        kind = self.core_attention.st_kind
        if (pattern is None or pattern.cp_group is None or pattern.query_range is not None or kind != "temporal"
                or not self.hidden_switch or self.core_attention.displaced is not None):  # (PipeFusion: q|k|v)
            return super().forward(hidden_states, attention_mask, packed_seq_params=packed_seq_params, **kwargs)
        if kwargs.get("rotary_pos_emb") is not None:
            raise ValueError("the ST-DiT's hidden-state switch takes no rotary embedding (its positions are the "
                             "sin-cos table); use model.position_embedding=sincos")

        def qkv_proj(y):  # [b, m, C] -> [b, m, heads, d] each (this rank's TP heads; GQA passes through)
            q, k, v = self.get_query_key_value_tensors(y.transpose(0, 1))
            return tuple(x.transpose(0, 1) for x in (q, k, v))

        def out_proj(o):  # [b, m, heads, d] -> [b, m, C] (row-parallel: reduced over TP)
            out, bias = self.linear_proj(o.transpose(0, 1).flatten(2))
            return (out if bias is None else out + bias).transpose(0, 1)

        out = st_hidden_attention(hidden_states.transpose(0, 1), kind=kind, layout=pattern.layout(), qkv_proj=qkv_proj,
                                  out_proj=out_proj, chunks=self._chunks(),
                                  softmax_scale=self.core_attention.softmax_scale,
                                  backend=self.core_attention.backend)
        return out.transpose(0, 1), None
