"""A launcher's start-up (the recipe scripts, the ``python -m dit_mcore.*`` commands): its imports with Python's cyclic
garbage collector paused.

Importing torch, megatron-core and nemo-run allocates about half a million objects that live as long as the
process. While they are imported, each of the collector's full passes rescans everything allocated so far (seven
passes, each time the heap has grown by a quarter), and after start-up every full pass rescans them all again.
Paused, then frozen (``gc.freeze``: later passes skip them, as pre-forking servers do), the collector runs as usual
on what the run itself allocates. Alternating runs on the 2-core CI machine (user + system CPU):
``recipes/pretrain_xl.py --help-config trainer`` 9-10 CPU-s against 17-20 in three of four pairs (the fourth: 18
against 22), a two-step ``pretrain_tiny`` run 28-32 against 47-52 in three of four (the fourth: 52 against 55).
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def imports_uncollected():
    """Pause the collector for the imports in the block, then freeze what they made and resume it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
