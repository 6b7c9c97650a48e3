"""A single-process megatron world for tests that build models outside a trainer."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def single_process_world(seed: int = 0) -> None:
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.parallel.initialize import initialize_distributed
    initialize_distributed(ParallelConfig(), seed)
