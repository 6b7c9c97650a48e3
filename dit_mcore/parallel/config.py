"""Parallel layout of a run."""
from dataclasses import dataclass

from dit_mcore.config import ConfigError


@dataclass
class ParallelConfig:
    """How the world is split. Data parallel size is whatever is left of the world."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel degree (splits attention heads and MLP width)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (splits layers)."""
    context_parallel_size: int = 1
    """Context parallel degree (splits the token sequence)."""
    sequence_parallel: bool = False
    """Shard activations outside TP regions along the sequence (requires TP > 1)."""

    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.model_parallel_size()
        if world_size % mp:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size = {mp}; change the parallel sizes "
                f"or the number of processes")
        return world_size // mp

    def validate(self, world_size: int) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("parallel.sequence_parallel=True needs tensor_model_parallel_size > 1")
        self.data_parallel_size(world_size)
