"""A single-process megatron world for tests that build models outside a trainer."""
from __future__ import annotations


def single_process_world(seed: int = 0) -> None:
    """Megatron's TP=PP=1 state in the pytest process, set up unless it already is. Not cached: a test
    before this one may have released it (a Trainer's first act, ``release_model_parallel_groups``)."""
    from megatron.core import parallel_state

    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.parallel.initialize import initialize_distributed
    if not parallel_state.model_parallel_is_initialized():
        initialize_distributed(ParallelConfig(), seed)
