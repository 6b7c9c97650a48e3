"""Layout-independent initialisation: every part of a model is initialised from its own RNG stream,
keyed by a base seed and the part's global name (``layers.7``, ``t_embedder`` …).

A pipeline stage builds only some parts, and in another order than one process does; with one
stream per part, global layer 7 gets the same initial weights whatever the layout, and the
conditioning embedders every stage holds start identical on all of them.
"""
from __future__ import annotations

import contextlib
import zlib

import torch
from megatron.core import parallel_state, tensor_parallel


def draw_base_seed() -> int:
    """A base seed from the caller's RNG (the same on every rank after the same ``manual_seed``)."""
    return int(torch.randint(2 ** 31 - 1, (1,)))


@contextlib.contextmanager
def init_stream(base_seed: int, key: str):
    """Run the enclosed construction on the RNG stream of part ``key``; the caller's RNG states are
    restored afterwards.

    Two sources are seeded: torch's generators (CPU, where megatron initialises each whole weight
    and splits it, and the current CUDA device) and megatron's model-parallel RNG tracker, which
    megatron's GPU initialisation of tensor/expert-parallel weights draws from (reseeded the way
    ``model_parallel_cuda_manual_seed`` does, so those weights still differ per TP/EP rank, as in
    megatron, but no longer per pipeline stage)."""
    seed = (base_seed * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 31 - 1)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = tracker.get_states()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if parallel_state.model_parallel_is_initialized():
            tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        try:
            yield
        finally:
            tracker.reset()
            tracker.set_states(saved)
