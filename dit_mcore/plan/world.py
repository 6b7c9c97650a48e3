"""A pretend world for tracing one rank of a layout: torch's fake process group (every collective
returns at once, nothing is sent) under megatron's real parallel state, so the run's own code builds
this rank's share of the model and its forward allocates what it would (gathered sequences, the
context-parallel exchange, the experts' token buffers) without the other ranks existing."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.initialize import initialize_model_parallel, release_model_parallel_groups


@contextlib.contextmanager
def traced_world(parallel: ParallelConfig, world_size: int, rank: int = 0) -> Iterator[None]:
    """Rank ``rank`` of ``world_size`` fake ranks in ``parallel``'s layout (rank 0: the first pipeline stage, where
    1F1B keeps the most micro-batches in flight). A one-process world found on entry is released (its
    users set it up again, as a trainer does); a real multi-process one is refused."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() > 1 and dist.get_backend() != "fake":
            raise ConfigError("the planner traces a layout in a process of its own: run it before "
                              "torch.distributed is initialised, not inside a launched job")
        release_model_parallel_groups()
        dist.destroy_process_group()
    if not torch.cuda.is_available():
        from dit_mcore.parallel.cpu_shims import apply_cpu_shims
        apply_cpu_shims()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        initialize_model_parallel(parallel, create_gloo_process_groups=False)
        yield
    finally:
        release_model_parallel_groups()
        dist.destroy_process_group()
