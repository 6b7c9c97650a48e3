"""Spatial-temporal (ST-DiT) attention on a context-parallel group.

A video of ``T`` frames x ``S = H*W`` positions is a token sequence ordered frame-major,
``[b, T*S, ...]``. Spatial attention runs within each frame (over S), temporal attention within
each position (over T). Both are batches of independent short sequences, so context
parallelism never needs a ring: it is enough that, for the attention about to run, every rank
holds *whole* sequences. The resident layout keeps one of T/S sharded; before the attention
whose sequence dim is sharded, one all-to-all switches the sharded dim (DSP, VideoSys
``dynamic_switch``), and one switches back after it.

Resident layouts (:class:`STLayout.sharded`):

* ``"S"`` (DSP): each rank of ``group`` holds every frame of one block of positions. Temporal
  attention is local; spatial attention switches (S -> T) and back.
* ``"T"`` (NeMo): each rank holds one block of frames, every position. Spatial is local,
  temporal switches (T -> S) and back.
* two-level mesh (``sharded="T"`` plus ``inner_group``): frames are blocked over ``group``
  (outer) and, within each frame, positions over ``inner_group``. Spatial attention is Ulysses
  over the inner group (one all-to-all scatters heads and gathers S, one swaps back); temporal
  attention switches T -> (local S block) inside the outer group only. The degree is
  ``outer * inner``, so it may exceed ``min(T, S)`` (DSP's limit).

Blocks: a dim of size ``D`` over ``P`` ranks is cut into blocks of ``c = ceil(D/P)``; rank ``r``
holds ``[r*c, min((r+1)*c, D))``. The last ranks may hold fewer rows (or none); nothing padded
is stored in the resident layout. A switch zero-pads its send buffer to equal blocks; the
padded rows of the newly sharded dim stay during the attention (each padded frame/position is
a sequence of its own, so it never mixes with real tokens and needs no mask) and the switch
back trims them. Their gradients are dropped by the trim, i.e. are exactly zero.

Images (``T == 1``): temporal attention is a softmax over a single key, so its output is ``v``
exactly (still computed, so the same code path holds). With ``sharded="S"`` the spatial switch
puts the one real frame on rank 0 and padding frames elsewhere: correct but unbalanced. For
images use the two-level mesh with an outer size of 1 (pure Ulysses over S).

Communication (per rank, forward; ``n`` = bytes of the local tensor being switched): a switch
is one ``all_to_all_single`` sending ``(P-1)/P * n_padded``. The hidden-state helper
:func:`st_attention` switches ``x`` (``C`` channels) once before the QKV projection and once
after the output projection: 2 switches per attention that needs one, i.e. DSP's 2 per
spatial+temporal pair. The q/k/v entry points switch q|k|v fused and the output: ``(2 + 2 h_kv/h)``
``C``-sized units, the Ulysses volume. Backward repeats each all-to-all once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .local_attention import local_attention
from .st_overlap import pipelined_switch
from .st_switch import _rank, _size, block_range, switch_shard

KINDS = ("spatial", "temporal")


@dataclass(frozen=True)
class STLayout:
    """Where a video's tokens live across the context-parallel mesh (see the module docstring)."""

    grid: tuple[int, int]
    """Global ``(T, S)``: frames and positions per frame (``S = H*W`` after patchify)."""
    group: Any = None
    """Process group sharding the resident dim (``sharded``); the switch group. None = WORLD."""
    sharded: str = "S"
    """Resident sharded dim over ``group``: ``"S"`` (positions, DSP) or ``"T"`` (frames)."""
    inner_group: Any = None
    """Two-level mesh only (needs ``sharded="T"``): shards the positions of each frame; spatial
    attention runs Ulysses (head scatter) over it. Build both groups with :func:`make_st_mesh`."""

    def __post_init__(self):
        if len(self.grid) != 2 or any(int(g) < 1 for g in self.grid):
            raise ValueError(f"STLayout.grid must be (T, S) with T, S >= 1, got {self.grid}")
        if self.sharded not in ("S", "T"):
            raise ValueError(f"STLayout.sharded must be 'S' (positions, DSP) or 'T' (frames), got {self.sharded!r}")
        if self.inner_group is not None and self.sharded != "T":
            raise ValueError("STLayout.inner_group (two-level mesh) needs sharded='T': frames over the outer "
                             "group, positions over the inner group")
        if self.inner_group is not None and dist.is_initialized():
            me = dist.get_rank()
            outer = set(dist.get_process_group_ranks(self.group or dist.group.WORLD))
            inner = set(dist.get_process_group_ranks(self.inner_group))
            if outer & inner != {me}:
                raise ValueError(f"STLayout: outer group {sorted(outer)} and inner group {sorted(inner)} must "
                                 f"share exactly this rank ({me}); build them with make_st_mesh")

    @property
    def inner_size(self) -> int:
        return 1 if self.inner_group is None else _size(self.inner_group)

    def local_ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's ``((t0, t1), (s0, s1))`` in the resident layout."""
        T, S = self.grid
        P, r = _size(self.group), _rank(self.group)
        if self.sharded == "S":
            return (0, T), block_range(S, P, r)
        if self.inner_group is None:
            return block_range(T, P, r), (0, S)
        return block_range(T, P, r), block_range(S, self.inner_size, _rank(self.inner_group))

    def local_grid(self) -> tuple[int, int]:
        (t0, t1), (s0, s1) = self.local_ranges()
        return t1 - t0, s1 - s0

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's resident tokens ``[b, nT*nS, ...]`` from the full ``[b, T*S, ...]``."""
        T, S = self.grid
        if x.shape[1] != T * S:
            raise ValueError(f"STLayout.shard: expected {T}*{S}={T * S} tokens in dim 1, got {x.shape[1]}")
        (t0, t1), (s0, s1) = self.local_ranges()
        g = torch.unflatten(x, 1, (T, S))[:, t0:t1, s0:s1]
        return g.flatten(1, 2)

    def plan(self, kind: str) -> str:
        """How ``kind`` attention runs: ``"local"``, ``"switch"`` (over ``group``) or ``"ulysses"``."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if kind == "spatial":
            if self.sharded == "S":
                return "switch" if _size(self.group) > 1 else "local"
            return "ulysses" if self.inner_size > 1 else "local"
        return "switch" if self.sharded == "T" and _size(self.group) > 1 else "local"

    def switch_dims(self, kind: str) -> tuple[int, int, tuple[int, int]]:
        """``(seq_dim, batch_dim, (seq_size, batch_size))`` of ``kind`` in the ``[b, T, S, ...]`` view;
        the sizes are the global sizes on the switch group."""
        T, S = self.grid
        if kind == "spatial":
            return 2, 1, (S, T)
        return 1, 2, (T, self.local_grid()[1])


def make_st_mesh(group, *, outer: int, inner: int) -> tuple[Any, Any]:
    """Split ``group`` (None = WORLD) into ``(outer_group, inner_group)`` for a two-level layout.

    Inner groups are contiguous ranks (put them inside a node: they carry the Ulysses traffic of
    every spatial attention). Every rank of ``group`` must call this (it creates groups).
    """
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if outer < 1 or inner < 1 or outer * inner != len(ranks):
        raise ValueError(f"make_st_mesh: outer ({outer}) * inner ({inner}) must equal the group size "
                         f"({len(ranks)})")
    me = dist.get_rank()
    mine = {}
    for o in range(outer):
        g = dist.new_group(ranks[o * inner:(o + 1) * inner])
        if me in ranks[o * inner:(o + 1) * inner]:
            mine["inner"] = g
    for u in range(inner):
        g = dist.new_group(ranks[u::inner])
        if me in ranks[u::inner]:
            mine["outer"] = g
    return mine["outer"], mine["inner"]


# --------------------------------------------------------------------------------------------
# attention on q/k/v


def _check_tokens(t: torch.Tensor, layout: STLayout, name: str):
    nT, nS = layout.local_grid()
    if t.dim() < 3 or t.shape[1] != nT * nS:
        raise ValueError(f"{name} must be [b, tokens, ...] with this rank's {nT}*{nS}={nT * nS} tokens of grid "
                         f"{layout.grid} (sharded={layout.sharded!r}); got shape {tuple(t.shape)}")


def _attend_grid(q, k, v, seq_dim: int, **kw) -> torch.Tensor:
    """Attention along ``seq_dim`` (1 = T, 2 = S) of ``[b, T', S', h, d]`` tensors, other dims batched."""
    if seq_dim == 1:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    b, n_bat, n_seq = q.shape[:3]
    # a tail rank may own no frames/positions: the primitives return empty results for empty input
    o = local_attention(*(t.reshape(b * n_bat, n_seq, *t.shape[3:]) for t in (q, k, v)), **kw)
    o = o.reshape(b, n_bat, n_seq, *o.shape[2:])
    return o.transpose(1, 2) if seq_dim == 1 else o


def _ulysses_spatial(q5, k5, v5, layout: STLayout, **kw):
    """Spatial attention with positions sharded over the inner group: scatter heads, gather S."""
    group, Pu = layout.inner_group, layout.inner_size
    h, hk = q5.shape[3], k5.shape[3]
    if h % Pu or hk % Pu:
        raise ValueError(f"two-level ST attention: query heads ({h}) and kv heads ({hk}) must be divisible by "
                         f"the inner (Ulysses) group size ({Pu}); choose an inner size dividing both")
    S = layout.grid[1]
    # Interleave so that each rank's head block is [its q heads | its k heads | its v heads]: one a2a.
    per_rank = [torch.unflatten(t, 3, (Pu, t.shape[3] // Pu)) for t in (q5, k5, v5)]
    qkv = torch.cat(per_rank, dim=4).flatten(3, 4)
    qkv = switch_shard(qkv, from_dim=2, to_dim=3, sizes=(S, qkv.shape[3]), group=group)
    qs, ks, vs = qkv.split([h // Pu, hk // Pu, hk // Pu], dim=3)
    o = _attend_grid(qs, ks, vs, 2, **kw)
    return switch_shard(o, from_dim=3, to_dim=2, sizes=(h, S), group=group, keep_padding=False)


def st_qkv_attention(q, k, v, *, kind: str, layout: STLayout, softmax_scale=None, backend="auto"):
    """Spatial or temporal attention on this rank's resident q ``[b, n, h, d]``, k/v ``[b, n, h_kv, d]``.

    ``n = nT*nS`` tokens of the resident layout, frame-major. Returns ``out [b, n, h, d]`` in the
    same layout. Gradients flow to q, k, v.
    """
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tokens(t, layout, name)
    nT, nS = layout.local_grid()
    b, n, h, d = q.shape
    hk = k.shape[2]
    kw = dict(softmax_scale=softmax_scale, backend=backend)
    q5, k5, v5 = (t.reshape(b, nT, nS, t.shape[2], t.shape[3]) for t in (q, k, v))
    mode = layout.plan(kind)
    if mode == "ulysses":
        o = _ulysses_spatial(q5, k5, v5, layout, **kw)
    elif mode == "switch":
        seq, bat, (A, B) = layout.switch_dims(kind)
        qkv = switch_shard(torch.cat([q5, k5, v5], dim=3), from_dim=seq, to_dim=bat, sizes=(A, B),
                           group=layout.group)
        o = _attend_grid(*qkv.split([h, hk, hk], dim=3), seq, **kw)
        o = switch_shard(o, from_dim=bat, to_dim=seq, sizes=(B, A), group=layout.group, keep_padding=False)
    else:
        o = _attend_grid(q5, k5, v5, 2 if kind == "spatial" else 1, **kw)
    return o.reshape(b, n, h, d)


def spatial_attention(q, k, v, *, layout: STLayout, softmax_scale=None, backend="auto"):
    """Attention within each frame (over S). See :func:`st_qkv_attention`."""
    return st_qkv_attention(q, k, v, kind="spatial", layout=layout, softmax_scale=softmax_scale, backend=backend)


def temporal_attention(q, k, v, *, layout: STLayout, softmax_scale=None, backend="auto"):
    """Attention within each position (over T). See :func:`st_qkv_attention`."""
    return st_qkv_attention(q, k, v, kind="temporal", layout=layout, softmax_scale=softmax_scale, backend=backend)


# --------------------------------------------------------------------------------------------
# attention on hidden states (the DSP form: switch x, not q/k/v)

QKVProj = Callable[[torch.Tensor], tuple]
OutProj = Callable[[torch.Tensor], torch.Tensor]


def _project_attend(g, seq_dim, qkv_proj: QKVProj, out_proj: OutProj, kw) -> torch.Tensor:
    """QKV projection, attention along ``seq_dim`` and output projection of ``[b, T', S', C]``."""
    b, nt, ns = g.shape[:3]
    q, k, v = qkv_proj(g.flatten(1, 2))
    q5, k5, v5 = (t.reshape(b, nt, ns, *t.shape[2:]) for t in (q, k, v))
    o = _attend_grid(q5, k5, v5, seq_dim, **kw)
    y = out_proj(o.flatten(1, 2))
    return y.reshape(b, nt, ns, *y.shape[2:])


def st_attention(x: torch.Tensor, *, kind: str, layout: STLayout, qkv_proj: QKVProj, out_proj: OutProj,
                 chunks: int = 1, softmax_scale=None, backend="auto") -> torch.Tensor:
    """A whole self-attention sub-layer on resident hidden states ``x [b, n, C]`` (``n = nT*nS``).

    ``qkv_proj(x [b, m, C]) -> (q, k, v)`` each ``[b, m, heads, d]`` and ``out_proj(o [b, m, h, d])
    -> [b, m, C_out]`` are any per-token callables (they must not mix tokens). When ``kind``
    attention needs a switch, ``x`` is switched before ``qkv_proj`` and the projected output is
    switched back (2 all-to-alls of hidden states). ``chunks > 1`` splits both switches into that
    many asynchronous all-to-alls along the batch of sequences, pipelined with the projections
    (same result as ``chunks=1``). Spatial attention on a two-level mesh projects locally and runs
    Ulysses on q/k/v (heads must then divide the inner size). Returns ``[b, n, C_out]``.
    """
    _check_tokens(x, layout, "x")
    if chunks < 1:
        raise ValueError(f"st_attention: chunks must be >= 1, got {chunks}")
    kw = dict(softmax_scale=softmax_scale, backend=backend)
    mode = layout.plan(kind)
    if mode != "switch":
        q, k, v = qkv_proj(x)
        return out_proj(st_qkv_attention(q, k, v, kind=kind, layout=layout, **kw))
    nT, nS = layout.local_grid()
    g = torch.unflatten(x, 1, (nT, nS))
    seq, bat, (A, B) = layout.switch_dims(kind)

    def compute(y):
        return _project_attend(y, seq, qkv_proj, out_proj, kw)

    if chunks == 1:
        y = switch_shard(g, from_dim=seq, to_dim=bat, sizes=(A, B), group=layout.group)
        out = switch_shard(compute(y), from_dim=bat, to_dim=seq, sizes=(B, A), group=layout.group,
                           keep_padding=False)
    else:
        out = pipelined_switch(g, compute, seq_dim=seq, bat_dim=bat, sizes=(A, B), group=layout.group,
                               chunks=chunks)
    return out.flatten(1, 2)
