"""Count the collectives a piece of code issues and the bytes this rank sends.

``with count_comm() as comm: ...`` wraps the ``torch.distributed.<op>`` functions for the
duration of the block and records one :class:`CommEvent` per call. Kernels call collectives as
``dist.<op>`` (``import torch.distributed as dist``), so replacing the module attributes is
enough; code that bound a function earlier (``from torch.distributed import all_to_all``),
torch-internal calls into ``distributed_c10d`` and functional collectives
(``torch.distributed._functional_collectives``) are NOT seen. Because only the public namespace
is wrapped, a call torch makes internally (``batch_isend_irecv`` -> ``isend``,
``all_gather_object`` -> ``all_gather``) is never counted twice.

Bytes sent: the bytes this rank must send in the direct model, where every piece of data
travels one hop from a rank that holds it to each rank that needs it. For the collectives used
by attention this equals the bandwidth-optimal ring algorithm, so it is algorithm-independent
in the sense that matters (it is what NCCL's ring/pairwise algorithms move per rank). With P
the group size and ``n`` the byte size of the named tensor:

=========================  ================================================================
op                         bytes sent by this rank
=========================  ================================================================
all_to_all_single          input bytes minus the block this rank keeps ((P-1)/P * n if even)
all_to_all                 sum of input_tensor_list[i] for i != own rank
all_gather_into_tensor     (P-1) * n(input)           (own shard to every peer; also all_gather_single)
all_gather                 (P-1) * n(tensor)
reduce_scatter_tensor      n(input) minus own block   ((P-1)/P * n if even; also reduce_scatter_single)
reduce_scatter             sum of input_list[i] for i != own rank
all_reduce                 reduce-scatter + all-gather: n - c + (P-1) * c, c = own 1/P chunk
                           (= 2 (P-1)/P * n when P divides the element count)
broadcast / scatter        source: (P-1) * n (scatter: the other ranks' chunks); others 0
reduce / gather            non-destination ranks: n; destination 0
send / isend               n
recv / irecv / barrier     0 (the call is still counted)
batch_isend_irecv          sum of n over its isend ops (one event for the batch)
=========================  ================================================================

A group of size 1 sends 0 bytes. Async calls are counted when issued.

The counter is re-entrant: nested or concurrent ``count_comm()`` blocks each see every call
made while they are open, the wrappers are installed by the first block to open and the
originals are restored when the last one closes. Backward passes that run on autograd worker
threads (CUDA) are recorded too, since the active counters are process-global.
"""
from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CommEvent:
    """One collective or point-to-point call seen by the counter."""

    op: str
    """Name of the ``torch.distributed`` function that was called."""
    bytes_sent: int
    """Bytes this rank sends for the call (see the module docstring for the model)."""
    group_size: int
    """Size of the process group the call ran on."""
    async_op: bool
    """True when the call returned a work handle instead of blocking."""


@dataclass(eq=False)  # identity matters: nested blocks remove their own counter
class CommCounter:
    """Events recorded on this rank while a ``count_comm()`` block was open."""

    events: list[CommEvent] = field(default_factory=list)
    """Every call in issue order."""

    def calls(self, op: str | None = None) -> int:
        """Number of calls of ``op`` (all ops when None)."""
        return sum(1 for e in self.events if op is None or e.op == op)

    def bytes_sent(self, op: str | None = None) -> int:
        """Bytes sent by ``op`` calls (all ops when None)."""
        return sum(e.bytes_sent for e in self.events if op is None or e.op == op)

    def summary(self) -> dict[str, dict[str, int]]:
        """``{op: {"calls": ..., "bytes_sent": ...}}`` for every op seen."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes_sent": 0})
        for e in self.events:
            out[e.op]["calls"] += 1
            out[e.op]["bytes_sent"] += e.bytes_sent
        return dict(out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _own_block_bytes(t: torch.Tensor, splits, size: int, rank: int) -> int:
    """Bytes of the dim-0 block of ``t`` that belongs to ``rank`` (even split unless ``splits``)."""
    if t.dim() == 0 or t.numel() == 0:
        return 0
    row = _nbytes(t) // t.shape[0]
    if splits is not None and len(splits):  # a list, tensor or numpy array (megatron's MoE dispatcher)
        return int(splits[rank]) * row
    return (t.shape[0] // size) * row


def _group_rank(group) -> int:
    return dist.get_rank(group)


def _is_root(a: dict, global_key: str, group_key: str) -> bool:
    if a.get(group_key) is not None:
        return _group_rank(a.get("group")) == a[group_key]
    return dist.get_rank() == a.get(global_key)


# Each entry maps the bound arguments of a call (plus group size and own group rank) to bytes.
def _a2a_single(a, p, r):
    return _nbytes(a["input"]) - _own_block_bytes(a["input"], a.get("input_split_sizes"), p, r)


def _all_reduce(a, p, r):
    n = _nbytes(a["tensor"])
    own = _nbytes(a["tensor"].reshape(-1).tensor_split(p)[r])
    return n - own + (p - 1) * own


_BYTES: dict[str, Callable[[dict, int, int], int]] = {
    "all_to_all_single": _a2a_single,
    "all_to_all": lambda a, p, r: sum(_nbytes(t) for i, t in enumerate(a["input_tensor_list"]) if i != r),
    "all_gather_into_tensor": lambda a, p, r: (p - 1) * _nbytes(a["input_tensor"]),
    "all_gather_single": lambda a, p, r: (p - 1) * _nbytes(a["input_tensor"]),
    "all_gather": lambda a, p, r: (p - 1) * _nbytes(a["tensor"]),
    "reduce_scatter_tensor": lambda a, p, r: _nbytes(a["input"]) - _own_block_bytes(a["input"], None, p, r),
    "reduce_scatter_single": lambda a, p, r: _nbytes(a["input"]) - _own_block_bytes(a["input"], None, p, r),
    "reduce_scatter": lambda a, p, r: sum(_nbytes(t) for i, t in enumerate(a["input_list"]) if i != r),
    "all_reduce": _all_reduce,
    "broadcast": lambda a, p, r: (p - 1) * _nbytes(a["tensor"]) if _is_root(a, "src", "group_src") else 0,
    "scatter": lambda a, p, r: (sum(_nbytes(t) for i, t in enumerate(a["scatter_list"]) if i != r)
                                if _is_root(a, "src", "group_src") else 0),
    "reduce": lambda a, p, r: 0 if _is_root(a, "dst", "group_dst") else _nbytes(a["tensor"]),
    "gather": lambda a, p, r: 0 if _is_root(a, "dst", "group_dst") else _nbytes(a["tensor"]),
    "send": lambda a, p, r: _nbytes(a["tensor"]),
    "isend": lambda a, p, r: _nbytes(a["tensor"]),
    "recv": lambda a, p, r: 0,
    "irecv": lambda a, p, r: 0,
    "barrier": lambda a, p, r: 0,
}

_P2P_SEND_OPS = ("isend",)


def _batch_bytes(p2p_op_list) -> int:
    return sum(_nbytes(op.tensor) for op in p2p_op_list
               if getattr(op.op, "__name__", "") in _P2P_SEND_OPS)


_lock = threading.Lock()
_active: list[CommCounter] = []
_originals: dict[str, object] = {}


def _record(event: CommEvent) -> None:
    with _lock:
        for counter in _active:
            counter.events.append(event)


def _wrap(name: str, fn: Callable) -> Callable:
    sig = inspect.signature(fn)
    bytes_of = _BYTES[name]

    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        a = bound.arguments
        group = a.get("group")
        size = dist.get_world_size(group)
        sent = 0 if size == 1 else bytes_of(a, size, _group_rank(group))
        _record(CommEvent(name, int(sent), size, bool(a.get("async_op", name in ("isend", "irecv")))))
        return fn(*args, **kwargs)

    wrapper.__name__ = name
    wrapper.__wrapped__ = fn
    return wrapper


def _wrap_batch(fn: Callable) -> Callable:
    def batch_isend_irecv(p2p_op_list):
        if p2p_op_list:
            group = p2p_op_list[0].group
            size = dist.get_world_size(group)
            _record(CommEvent("batch_isend_irecv", _batch_bytes(p2p_op_list) if size > 1 else 0, size, True))
        return fn(p2p_op_list)

    batch_isend_irecv.__wrapped__ = fn
    return batch_isend_irecv


def _unwrap(op):
    return getattr(op, "__wrapped__", op)


def _make_p2p_op_class(base: type) -> type:
    # P2POp checks ``op in [isend, irecv]`` and batch_isend_irecv tests ``op.op is isend``
    # against the unwrapped functions, so the op stored must be the original.
    class P2POp(base):
        def __new__(cls, op, *args, **kwargs):
            return base.__new__(cls, _unwrap(op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(_unwrap(op), *args, **kwargs)

    P2POp.__qualname__ = base.__qualname__
    P2POp.__doc__ = base.__doc__
    return P2POp


def _install() -> None:
    for name in _BYTES:
        if not hasattr(dist, name):  # the *_single names are recent; older torch lacks them
            continue
        _originals[name] = getattr(dist, name)
        setattr(dist, name, _wrap(name, _originals[name]))
    _originals["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _wrap_batch(dist.batch_isend_irecv)
    _originals["P2POp"] = dist.P2POp
    dist.P2POp = _make_p2p_op_class(dist.P2POp)


def _uninstall() -> None:
    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()


@contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Record every ``torch.distributed`` collective issued inside the block on this rank."""
    counter = CommCounter()
    with _lock:
        if not _active:
            _install()
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)
            if not _active:
                _uninstall()
