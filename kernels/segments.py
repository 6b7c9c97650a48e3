"""The block-diagonal pattern of a packed (THD) sequence and the kernel plans derived from it.

A :class:`Segments` is built once per micro-batch and handed to every attention layer, so
everything the kernels need from it is computed on first use and cached on the object:

* :attr:`Segments.runs` (host ints): the segments grouped into *runs*, consecutive segments of
  equal lengths at a constant stride. A run is one strided view of q/k/v, hence one batched
  dense kernel call with no gather: a pack of same-size images is a single run.
* :meth:`Segments.varlen` (device tensors, one set per device): ``cu_seqlens``, max lengths and
  token indices for the varlen GPU kernels, built without a host sync after the first call.
* :meth:`Segments.restrict` results (the per-block patterns of a ring), so a ring step in layer
  ``n`` reuses the plans built in layer 1.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .host_copy import to_device


@dataclass(frozen=True)
class Run:
    """``n`` segments with equal lengths at constant strides: ``[n, len, ...]`` views of q and k."""

    n: int
    q_start: int
    q_stride: int
    q_len: int
    k_start: int
    k_stride: int
    k_len: int

    def extend(self, a: int, e: int, c: int, f: int) -> "Run | None":
        """This run plus segment ``(a, e, c, f)`` if that keeps it one strided view, else None.

        Strides must be at least the lengths so views never overlap: gradients are added through
        the views, which is only defined for non-overlapping memory.
        """
        if e - a != self.q_len or f - c != self.k_len:
            return None
        if self.n == 1:
            qs, ks = a - self.q_start, c - self.k_start
            if qs < self.q_len or ks < self.k_len:
                return None
            return Run(2, self.q_start, qs, self.q_len, self.k_start, ks, self.k_len)
        if a != self.q_start + self.n * self.q_stride or c != self.k_start + self.n * self.k_stride:
            return None
        return Run(self.n + 1, self.q_start, self.q_stride, self.q_len, self.k_start, self.k_stride, self.k_len)

    def q_view(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, q_len, ...]`` view of the query-side tensor ``x [1, s_q, ...]``."""
        return _strided_tokens(x, self.n, self.q_start, self.q_stride, self.q_len)

    def k_view(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, k_len, ...]`` view of the key-side tensor ``x [1, s_kv, ...]``."""
        return _strided_tokens(x, self.n, self.k_start, self.k_stride, self.k_len)

    def lse_view(self, lse: torch.Tensor) -> torch.Tensor:
        """``[n, h, q_len]`` view of ``lse [1, h, s_q]``."""
        windows = lse[0, :, self.q_start:].unfold(1, self.q_len, self.q_stride)  # [h, W, q_len]
        return windows[:, :self.n].transpose(0, 1)

    def covers(self, s_q: int, s_kv: int) -> bool:
        """True when the run's views are the whole tensors (reshapes, nothing to copy or zero)."""
        return (self.q_start == 0 and self.k_start == 0 and self.q_stride == self.q_len
                and self.k_stride == self.k_len and self.n * self.q_len == s_q and self.n * self.k_len == s_kv)


def _strided_tokens(x, n, start, stride, length):
    """``[n, length, ...]`` view of ``x [1, s, ...]``: ``n`` windows of ``length`` tokens every
    ``stride`` tokens from ``start``. ``unfold`` rather than ``as_strided``: no ``storage_offset()``,
    which breaks ``torch.compile`` graphs under dynamic shapes (and torch 2.13 then resumes the
    frame with a mangled stack)."""
    return x[0, start:].unfold(0, length, stride)[:n].movedim(-1, 1)


@dataclass(frozen=True, eq=False)
class Varlen:
    """Device-side description of the non-empty segments for varlen kernels.

    Tokens are packed in segment order; when the real tokens of one side already form one
    contiguous range the kernels slice it instead of gathering (``*_index`` is then None).
    """

    cu_q: torch.Tensor
    """int32 [n+1]: cumulative query lengths of the packed real tokens."""
    cu_k: torch.Tensor
    """int32 [n+1]: cumulative key lengths."""
    max_q: int
    max_k: int
    q_range: tuple[int, int]
    """Token range of the packed queries when they are contiguous (else the index is used)."""
    k_range: tuple[int, int]
    q_index: torch.Tensor | None
    """int64 [total_q]: token of each packed query (None when ``q_range`` is exact)."""
    k_index: torch.Tensor | None
    q_segment: torch.Tensor
    """int64 [total_q]: segment of each packed query (for kernels with a per-segment lse layout)."""
    q_position: torch.Tensor
    """int64 [total_q]: position of each packed query within its segment."""
    q_pad: torch.Tensor | None = None
    """int64: packed query rows that are padding between segments (see :func:`_fill_gaps`), or None."""
    k_pad: torch.Tensor | None = None
    """int64: packed key rows that are padding between segments, or None."""

    def pack_q(self, x: torch.Tensor) -> torch.Tensor:
        """``[total_q, ...]`` real query tokens of ``x [1, s_q, ...]``."""
        return _pack(x[0], self.q_range, self.q_index)

    def pack_k(self, x: torch.Tensor) -> torch.Tensor:
        return _pack(x[0], self.k_range, self.k_index)

    def pack_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """``[h, total_q]`` rows of ``lse [1, h, s_q]`` for a backward: padding rows between segments
        at +inf, so their probabilities are 0 and they send no gradient (see :func:`_fill_gaps`)."""
        packed = self.pack_q(lse.transpose(1, 2)).t()
        return packed if self.q_pad is None else packed.index_fill(1, self.q_pad, float("inf"))

    def unpack_q(self, dst: torch.Tensor, src: torch.Tensor, pad_value: float = 0.0) -> None:
        """Write packed query rows ``src`` back into ``dst [1, s_q, ...]`` (other rows untouched);
        rows of padding between segments get ``pad_value`` (``src`` is overwritten there)."""
        if self.q_pad is not None:
            src.index_fill_(0, self.q_pad, pad_value)
        if self.q_index is None:
            dst[0, self.q_range[0]:self.q_range[1]] = src
        else:
            dst[0].index_copy_(0, self.q_index, src)

    def add_k(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Add packed key rows ``src`` into ``dst [1, s_kv, ...]``: a key shared by several
        segments (packed once per segment) gets the sum of its gradients; rows of padding between
        segments add nothing (``src`` is zeroed there)."""
        if self.k_pad is not None:
            src.index_fill_(0, self.k_pad, 0.0)
        if self.k_index is None:
            dst[0, self.k_range[0]:self.k_range[1]] += src
        else:
            dst[0].index_add_(0, self.k_index, src)


def _pack(x, rng, index):
    return x[rng[0]:rng[1]] if index is None else x.index_select(0, index)


@dataclass(frozen=True)
class Segments:
    """Block-diagonal attention pattern of a packed (THD) sequence, as host-side int tuples.

    Query segment ``i`` covers tokens ``[q_starts[i], q_ends[i])`` and attends only to key tokens
    ``[kv_starts[i], kv_ends[i])``; tokens in no segment are padding.
    """

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

    @functools.cached_property
    def _memo(self) -> dict:
        # Per-object cache (restricted patterns, per-device tensors). cached_property writes
        # straight to __dict__, so it works on a frozen dataclass and stays out of eq/hash.
        return {}

    def restrict(self, q0: int, q1: int, k0: int, k1: int) -> "Segments":
        """The pattern seen by the query block ``[q0, q1)`` against the key block ``[k0, k1)``,
        in block-local coordinates (segments outside a block become empty). Cached."""
        key = ("restrict", q0, q1, k0, k1)
        if key not in self._memo:
            def clip(xs, lo, hi):
                return tuple(min(max(x - lo, 0), hi - lo) for x in xs)
            self._memo[key] = Segments(clip(self.q_starts, q0, q1), clip(self.q_ends, q0, q1),
                                       clip(self.kv_starts, k0, k1), clip(self.kv_ends, k0, k1))
        return self._memo[key]

    def nonempty(self):
        """(q_start, q_end, kv_start, kv_end) of segments with both queries and keys."""
        return [(a, b, c, d) for a, b, c, d in zip(self.q_starts, self.q_ends, self.kv_starts, self.kv_ends)
                if b > a and d > c]

    def max_q_end(self) -> int:
        return max(self.q_ends, default=0)

    def max_kv_end(self) -> int:
        return max(self.kv_ends, default=0)

    @functools.cached_property
    def runs(self) -> tuple[Run, ...]:
        """The non-empty segments as maximal runs of consecutive equal, evenly strided segments."""
        runs: list[Run] = []
        for a, e, c, f in self.nonempty():
            grown = runs[-1].extend(a, e, c, f) if runs else None
            if grown is None:
                runs.append(Run(1, a, e - a, e - a, c, f - c, f - c))
            else:
                runs[-1] = grown
        return tuple(runs)

    def varlen(self, device: torch.device) -> Varlen:
        """The :class:`Varlen` tensors on ``device``, built once per device."""
        key = ("varlen", torch.device(device))
        if key not in self._memo:
            self._memo[key] = _build_varlen(self.nonempty(), key[1])
        return self._memo[key]


def _build_varlen(segs, device) -> Varlen:
    filled = _fill_gaps(segs)
    q_pad = k_pad = None
    if filled is not None:
        segs, q_gaps, k_gaps = filled
        q_pad = to_device(q_gaps, device, torch.int64) if q_gaps else None
        k_pad = to_device(k_gaps, device, torch.int64) if k_gaps else None
    q_lens = [e - a for a, e, _, _ in segs]
    k_lens = [f - c for _, _, c, f in segs]

    def cumulative(lens):
        return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)

    def tokens(ranges):
        lo, hi = ranges[0][0], ranges[-1][1]
        if all(e0 == a1 for (_, e0), (a1, _) in zip(ranges[:-1], ranges[1:])):
            return (lo, hi), None
        return (0, 0), to_device(torch.cat([torch.arange(a, e) for a, e in ranges]), device)

    q_range, q_index = tokens([(a, e) for a, e, _, _ in segs])
    k_range, k_index = tokens([(c, f) for _, _, c, f in segs])
    q_segment = torch.repeat_interleave(torch.arange(len(segs)), torch.tensor(q_lens))
    q_position = torch.cat([torch.arange(n) for n in q_lens])
    return Varlen(to_device(cumulative(q_lens), device), to_device(cumulative(k_lens), device), max(q_lens),
                  max(k_lens), q_range, k_range, q_index, k_index, to_device(q_segment, device),
                  to_device(q_position, device), q_pad, k_pad)


def _fill_gaps(segs):
    """``(segments, q_pad, k_pad)``: ``segs`` reshaped so that the queries and the keys each form one
    contiguous token range, letting the varlen kernels take q, k, v, out and the gradients as
    slices where a gather/scatter copy of each was needed (22 ms of index copies per packed 3B
    step on an H200). Padding between two segments becomes a segment of its own when it has
    tokens on both sides; padding queries facing no padding keys (cross-attention to packed text)
    join the segment before them. ``q_pad``/``k_pad`` are those padding rows, packed: the forward
    clears their output (:meth:`Varlen.unpack_q`), the backward gives them lse = +inf, so their
    probabilities, hence every gradient they could send, are exactly 0 (:meth:`Varlen.pack_lse`).
    None when segments overlap or go back (shared keys) or padding keys face no padding queries:
    the caller then gathers."""
    filled, q_pad, k_pad = [], [], []
    q0, k0 = segs[0][0], segs[0][2]
    for (a, e, c, f), (a2, _, c2, _) in zip(segs, segs[1:]):
        if a2 < e or c2 < f or (c2 > f and a2 == e):
            return None
        q_pad.extend(range(e - q0, a2 - q0))
        k_pad.extend(range(f - k0, c2 - k0))
        filled += [(a, e, c, f), (e, a2, f, c2)] if c2 > f else [(a, a2, c, f)]
    filled.append(segs[-1])
    return filled, q_pad, k_pad


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
