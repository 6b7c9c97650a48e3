"""One rank's memory for a run in a layout, predicted before any process group exists: the
per-parameter state counted from this rank's share of the model (:func:`training.parallelize.state_budget`,
the count the trainer itself checks against the device), plus the activations of the micro-batches
a pipeline stage keeps in flight, from a symbolic trace of the run's own code
(:mod:`dit_mcore.plan.trace`), plus what FSDP gathers and the device's fixed workspace.

Checked against a real step's live memory on CPU (``tests/test_plan_memory.py``): the state within
megatron's bucket padding, the whole peak within 5% in every tested layout (``docs/planning.md``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from megatron.core import parallel_state
from torch._subclasses.fake_tensor import FakeTensorMode

from dit_mcore.plan.trace import run_parts, fake_chunks, forget_cached_tables, layer_profile
from dit_mcore.plan.world import traced_world
from dit_mcore.training.memory import GiB, StateBudget
from dit_mcore.training.parallelize import shards_ema, state_budget


@dataclass(frozen=True)
class MemoryPrediction:
    """One rank's bytes at the peak of a training step."""

    state: StateBudget
    """Weights, gradient buffers, main weights, Adam's moments, EMA."""
    activations: float
    """What the micro-batches in flight hold at the worst moment of the step (saved tensors, the
    backward's working set, the layout's communication buffers that go through torch's allocator)."""
    gathered: float
    """FSDP: the whole weights of the layers being computed and prefetched, and their gradients before
    the reduce-scatter (0 without FSDP)."""
    workspace: float
    """The device's fixed reservation (cuBLAS and NCCL workspaces, allocator slack): from the GPU table; 0 on CPU."""
    microbatches_in_flight: int
    stage_layers: int

    @property
    def total(self) -> float:
        return self.state.total + self.activations + self.gathered + self.workspace

    def parts_gib(self) -> dict:
        s = self.state
        parts = dict(weights=s.weights, gradients=s.gradients, optimizer=s.main_weights + s.adam, ema=s.ema,
                     activations=self.activations, gathered=self.gathered, workspace=self.workspace)
        return {name: float(f"{b / GiB:.5g}") for name, b in (parts | {"total": self.total}).items()}


def in_flight(pipeline: int, virtual: int, microbatches: int) -> float:
    """Micro-batches whose saved tensors the first pipeline stage holds at once, in units of its whole
    share of layers: ``min(p, m)`` under 1F1B; interleaved over ``v`` chunks, megatron's
    ``1 + (p - 1) / (p v)`` stages' worth (Narayanan et al., SC'21)."""
    if pipeline == 1:
        return 1
    if virtual > 1:
        return min(microbatches, pipeline) * (1 + (pipeline - 1) / (pipeline * virtual))
    return min(microbatches, pipeline)


def stage_layers(cfg) -> int:
    """Layers on the first pipeline stage (all of them without pipeline parallelism)."""
    p = cfg.parallel
    if p.pipeline_model_parallel_size == 1:
        return cfg_layers(cfg)
    if p.num_layers_in_first_pipeline_stage:
        return p.num_layers_in_first_pipeline_stage
    middle = p.pipeline_model_parallel_size - (p.num_layers_in_last_pipeline_stage is not None)
    return (cfg_layers(cfg) - (p.num_layers_in_last_pipeline_stage or 0)) // middle


def cfg_layers(cfg) -> int:
    return cfg.model.build(cfg.parallel, bf16=cfg.trainer.bf16).num_layers


def _shape(batch) -> tuple:
    """What a micro-batch's activations depend on: its token layout and its samples' (and texts') lengths."""
    return tuple(batch.tokens.shape), batch.seqlens, batch.text_seqlens


def predict_memory(cfg, world_size: int, batches, *, workspace: float = 0.0, on_gpu: bool = False) -> MemoryPrediction:
    """Rank 0's memory at the peak of a training step of ``cfg`` on ``world_size`` ranks whose
    micro-batches are ``batches`` (one or several of this data-parallel rank's, before the layout splits
    their tokens: the peak is the worst one's).
    ``on_gpu``: the optimizer the trainer picks on a GPU (``optim.adam_impl=auto``: the flat AdamW) and the
    GPU's fused kernels in the trace (:func:`~dit_mcore.plan.device_kernels.gpu_kernels`)."""
    cfg = gpu_optimizer(cfg) if on_gpu else cfg
    with traced_world(cfg.parallel, world_size):
        shapes = {_shape(b): b for b in (batches if isinstance(batches, (list, tuple)) else [batches])}
        profiles = [layer_profile(cfg, b, on_gpu=on_gpu) for b in shapes.values()]
        model = RankModel.build(cfg)
        return rank_memory(cfg, profiles, model, rank_state(cfg, model), parallel_state.get_data_parallel_world_size(),
                           workspace)


def gpu_optimizer(cfg):
    """``cfg`` with the AdamW the trainer picks on a GPU (``optim.adam_impl=auto``: the flat one; with
    ``optim.cpu_offload`` megatron's offload steps its own)."""
    cfg = copy.deepcopy(cfg)
    if cfg.optim.adam_impl == "auto" and not cfg.optim.cpu_offload:
        cfg.optim.adam_impl = "flat"
    return cfg


@dataclass(frozen=True)
class RankModel:
    """This rank's share of the whole model, built on fake tensors (its parameters' sizes are what count)."""

    config: object
    chunks: object
    layer_bytes: float
    """The largest layer's weights, whole."""
    weight_bytes: float
    """All of this rank's share (TP/PP/EP) of the weights, unsharded by data parallelism or FSDP."""
    numel: int

    @classmethod
    def build(cls, cfg) -> "RankModel":
        """In the layout's (traced) world."""
        model_config = run_parts(cfg, cfg_layers(cfg))[0]
        try:
            with FakeTensorMode():
                chunks = fake_chunks(cfg, model_config)
        finally:
            forget_cached_tables()
        layer = max((sum(p.numel() * p.element_size() for p in layer.parameters())
                     for chunk in chunks for layer in chunk.layers), default=0)
        params = list(chunks.parameters())
        return cls(model_config, chunks, layer, sum(p.numel() * p.element_size() for p in params),
                   sum(p.numel() for p in params))


def rank_state(cfg, model: RankModel):
    """Rank 0's per-parameter state (weights, gradients, optimizer, EMA), inside the layout's traced world
    (which sets the data-parallel sizes that shard it). It does not depend on the micro-batch, recompute or
    chunking."""
    with FakeTensorMode():
        return state_budget(cfg, model.chunks, model.config, shards_ema(cfg, model.chunks))


def rank_memory(cfg, profiles: list, model: RankModel, state, dp: int, workspace: float = 0.0) -> MemoryPrediction:
    """Rank 0's peak from the traced micro-batches' ``profiles`` (the worst counts), its ``model``, its
    :func:`rank_state` and the layout's data-parallel size ``dp``."""
    layers = stage_layers(cfg)
    p = cfg.parallel
    flight = in_flight(p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1,
                       cfg.data.num_microbatches(dp))
    activations = max(profile.in_flight(layers, flight) for profile in profiles)
    # FSDP: the whole weights of the layer being computed (measured on CPU: one layer's worth over the
    # step's activations; a GPU's prefetch of the next layer is not yet measured)
    gathered = model.layer_bytes if p.fsdp != "none" else 0.0
    return MemoryPrediction(state, activations, gathered, workspace, int(round(flight)), layers)
