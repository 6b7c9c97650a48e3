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


def draw_base_seed() -> int:
    """A base seed from the caller's RNG (the same on every rank after the same ``manual_seed``)."""
    return int(torch.randint(2 ** 31 - 1, (1,)))


@contextlib.contextmanager
def init_stream(base_seed: int, key: str):
    """Run the enclosed construction on the RNG stream of part ``key``; the caller's RNG state is
    restored afterwards (CPU, and the current CUDA device where parameters are created)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((base_seed * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 63 - 1))
        yield
