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
    stage: int = 0
    """The pipeline stage this is (the one whose peak is the highest, where the planner chose)."""

    @property
    def total(self) -> float:
        return self.state.total + self.activations + self.gathered + self.workspace

    def parts_gib(self) -> dict:
        s = self.state
        parts = dict(weights=s.weights, gradients=s.gradients, optimizer=s.main_weights + s.adam, ema=s.ema,
                     activations=self.activations, gathered=self.gathered, workspace=self.workspace)
        return {name: float(f"{b / GiB:.5g}") for name, b in (parts | {"total": self.total}).items()}


def in_flight(pipeline: int, virtual: int, microbatches: int, stage: int = 0) -> float:
    """Micro-batches whose saved tensors pipeline stage ``stage`` holds at once, in units of its whole share of
    layers: ``min(p - stage, m)`` under 1F1B (the first stage the most); interleaved over ``v`` chunks, megatron's
    warm-up of ``2 (p - stage - 1) + (v - 1) p`` chunk-micro-batches plus the one in its backward (at most the
    step's ``m v``), over ``v`` (on the first stage ``p + (p - 1) / v``: Narayanan et al., SC'21)."""
    if pipeline == 1:
        return 1
    if virtual > 1:  # (all of a step's chunk-micro-batches where the warm-up would exceed them)
        return min(2 * (pipeline - stage - 1) + (virtual - 1) * pipeline + 1, microbatches * virtual) / virtual
    return min(microbatches, pipeline - stage)


def stage_split(cfg) -> list[int]:
    """Layers on each pipeline stage, as megatron splits them: ``parallel.num_layers_in_first/last_pipeline_stage``
    where set, the rest evenly over the other stages."""
    p = cfg.parallel
    pp, layers = p.pipeline_model_parallel_size, cfg_layers(cfg)
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    if pp == 1:
        return [layers]
    middle = pp - (first is not None) - (last is not None)
    each = (layers - (first or 0) - (last or 0)) // middle if middle else 0
    return ([first] if first is not None else []) + [each] * middle + ([last] if last is not None else [])


def stages_to_check(cfg) -> list[int]:
    """The pipeline stages whose memory can be the peak: the first (the most micro-batches in flight) where the
    layers split evenly; with an uneven split also the second (the most in flight of the middle ones) and the
    last (the most layers, as a rule)."""
    split = stage_split(cfg)
    return [0] if len(set(split)) == 1 else sorted({0, 1, len(split) - 1})


def stage_rank(parallel, world_size: int, stage: int) -> int:
    """The first rank of pipeline stage ``stage`` (megatron's order: the pipeline outermost)."""
    return stage * (world_size // parallel.pipeline_model_parallel_size)


def cfg_layers(cfg) -> int:
    return cfg.model.build(cfg.parallel, bf16=cfg.trainer.bf16).num_layers


def _shape(batch) -> tuple:
    """What a micro-batch's activations depend on: its token layout and its samples' (and texts') lengths."""
    return tuple(batch.tokens.shape), batch.seqlens, batch.text_seqlens


def predict_memory(cfg, world_size: int, batches, *, workspace: float = 0.0, on_gpu: bool = False,
                   stage: int = 0) -> MemoryPrediction:
    """The memory of pipeline stage ``stage``'s first rank (rank 0 by default) at the peak of a training step of
    ``cfg`` on ``world_size`` ranks whose
    micro-batches are ``batches`` (one or several of this data-parallel rank's, before the layout splits
    their tokens: the peak is the worst one's).
    ``on_gpu``: the optimizer the trainer picks on a GPU (``optim.adam_impl=auto``: the flat AdamW) and the
    GPU's fused kernels in the trace (:func:`~dit_mcore.plan.device_kernels.gpu_kernels`)."""
    cfg = gpu_optimizer(cfg) if on_gpu else cfg
    with traced_world(cfg.parallel, world_size, rank=stage_rank(cfg.parallel, world_size, stage)):
        shapes = {_shape(b): b for b in (batches if isinstance(batches, (list, tuple)) else [batches])}
        profiles = [layer_profile(cfg, b, on_gpu=on_gpu) for b in shapes.values()]
        model = RankModel.build(cfg)
        return rank_memory(cfg, profiles, model, rank_state(cfg, model), parallel_state.get_data_parallel_world_size(),
                           workspace, stage)


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
    """This rank's per-parameter state (weights, gradients, optimizer, EMA), inside the layout's traced world
    (which sets the data-parallel sizes that shard it). It does not depend on the micro-batch, recompute or
    chunking."""
    with FakeTensorMode():
        return state_budget(cfg, model.chunks, model.config, shards_ema(cfg, model.chunks))


def rank_memory(cfg, profiles: list, model: RankModel, state, dp: int, workspace: float = 0.0,
                stage: int = 0) -> MemoryPrediction:
    """The peak of a rank of pipeline stage ``stage`` from the traced micro-batches' ``profiles`` (the worst
    counts), its ``model``, its :func:`rank_state` and the layout's data-parallel size ``dp``."""
    layers = stage_split(cfg)[stage]
    p = cfg.parallel
    flight = in_flight(p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1,
                       cfg.data.num_microbatches(dp), stage)
    activations = max(profile.in_flight(layers, flight) for profile in profiles)
    # FSDP: the whole weights of the layer being computed (measured on CPU: one layer's worth over the
    # step's activations; a GPU's prefetch of the next layer is not yet measured)
    gathered = model.layer_bytes if p.fsdp != "none" else 0.0
    return MemoryPrediction(state, activations, gathered, workspace, int(round(flight)), layers, stage)
