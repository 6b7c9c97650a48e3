"""The peak of live tensor memory over a stretch of work, on any device (the CPU's too) and on fake
tensors: a dispatch mode that sees every storage an operator creates, and a weak reference on each
that counts it free when its last user lets go. It is the planner's ruler, both sides: a real step
measured (what ``torch.cuda.max_memory_allocated`` reports on a GPU, less the caching allocator's
rounding) and a traced one predicted (under ``FakeTensorMode`` nothing is allocated, but storages are
still born and die).

Memory that bypasses the dispatcher (a collective's internal buffers, a kernel's workspace) is not
seen; storages that existed before the mode entered count only through :attr:`LiveMemory.base`.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storages(values) -> list:
    return [t.untyped_storage() for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


class LiveMemory(TorchDispatchMode):
    """``with LiveMemory(base=B) as m: work()``; then ``m.peak`` is ``B`` plus the most bytes the
    storages created inside were holding at once, and ``m.live`` what they hold at the end. ``mark``
    names the phase the peak falls in (``m.phase`` is recorded with it as ``m.peak_phase``)."""

    def __init__(self, base: float = 0.0):
        super().__init__()
        self.base = float(base)
        self.live = 0.0
        self.peak = float(base)
        self.phase: Optional[str] = None
        self.peak_phase: Optional[str] = None
        self._held: dict[int, tuple[weakref.ref, int]] = {}

    def mark(self, phase: str) -> None:
        self.phase = phase

    def _free(self, key: int) -> None:
        _, nbytes = self._held.pop(key, (None, 0))
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(s) for s in _storages((args, kwargs))}
        for storage in _storages(out):
            key = id(storage)
            if key in inputs or key in self._held:
                continue  # a view, an in-place or out= result: no new memory
            nbytes = storage.nbytes()
            self._held[key] = (weakref.ref(storage, lambda _, k=key: self._free(k)), nbytes)
            self.live += nbytes
        if self.base + self.live > self.peak:
            self.peak, self.peak_phase = self.base + self.live, self.phase
        return out
