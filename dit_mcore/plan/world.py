"""A pretend world for tracing one rank of a layout: torch's fake process group (every collective
returns at once, nothing is sent) under megatron's real parallel state, so the run's own code builds
this rank's share of the model and its forward allocates what it would (gathered sequences, the
context-parallel exchange, the experts' token buffers) without the other ranks existing."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.initialize import release_model_parallel_groups


@contextlib.contextmanager
def traced_world(parallel: ParallelConfig, world_size: int) -> Iterator[None]:
    """Rank 0 of ``world_size`` fake ranks in ``parallel``'s layout (the first pipeline stage, where
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
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            hierarchical_context_parallel_sizes=parallel.hierarchical_context_parallel_sizes,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            num_distributed_optimizer_instances=parallel.fsdp_replicas(world_size),
            create_gloo_process_groups=False)
        yield
    finally:
        release_model_parallel_groups()
        dist.destroy_process_group()
