"""Generation layouts: training's ``parallel.*`` names (tensor, context/sequence, pipeline parallel,
checked by the same layout check) plus what sampling adds, over ``world = items x cfg x TP x CP x PP``.

- ``parallel.cfg_parallel=2``: the conditional and unconditional halves of classifier-free guidance
  on two ranks, which exchange their predictions each step (one all-gather of the latent's size).
- ``parallel.pipefusion=N`` (``pipefusion_patches=M``, ``pipefusion_warmup_steps=W``): PipeFusion,
  the layers in N pipeline stages and each item's tokens in M patches streaming through them
  (:mod:`dit_mcore.generate.pipefusion`); its stages are megatron's pipeline stages.
- Data parallel over items: whatever is left of megatron's data-parallel ranks shares the items out
  (each rank its contiguous block, :func:`dit_mcore.generate.items.share`).
- The ST-DiT's context-parallel path is the layout's, not the checkpoint's (:func:`st_attention_for`).

megatron's data-parallel group spans ``items x cfg``; its consecutive pairs are the CFG groups.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.layout import check_layout
from energon_data.config import DataConfig


@dataclass
class GenerateParallel(ParallelConfig):
    """A generation layout: :class:`ParallelConfig` plus the sampling axes."""

    cfg_parallel: int = 1
    """1: both halves of guidance in one batched call; 2: one half per rank (CFG-parallel)."""

    pipefusion: int = 1
    """PipeFusion's pipeline stages N (1: off, unless ``pipefusion_patches`` > 1 on one stage)."""
    pipefusion_patches: int = 0
    """PipeFusion's patches M per item (0: as many as stages)."""
    pipefusion_warmup_steps: int = 1
    """Sampler steps run synchronously on the whole item before the patches run displaced."""

    def patches(self) -> int:
        """Patches per item under PipeFusion (1: PipeFusion is off)."""
        return self.pipefusion_patches or self.pipefusion

    def staged(self) -> "GenerateParallel":
        """The megatron layout: PipeFusion's stages are megatron's pipeline stages."""
        if self.pipefusion > 1:
            return dataclasses.replace(self, pipeline_model_parallel_size=self.pipefusion)
        return self

    def items_parallel_size(self, world_size: int) -> int:
        """Ranks that share the items out: the data-parallel ranks over the CFG pairs."""
        return self.data_parallel_size(world_size) // self.cfg_parallel


def st_attention_for(p: GenerateParallel, trained: Optional[str]) -> str:
    """The ST-DiT's attention path (``model.st_attention``) under the generation layout ``p``, whatever path the
    checkpoint trained with (``trained``; the same weights compute the same function on each): the two-level mesh
    where the layout gives one (context parallel with ``hierarchical_context_parallel_sizes=[inner, outer]``, no
    PipeFusion, whose displaced layers gather every rank's keys and values instead of any path's exchange), else
    DSP (``dsp_overlap`` kept from the checkpoint)."""
    if p.context_parallel_size > 1 and p.hierarchical_context_parallel_sizes and p.patches() == 1:
        return "mesh"
    return trained if trained in ("dsp", "dsp_overlap") else "dsp"


def check_generation_layout(p: GenerateParallel, model_config, world_size: int, *, shape: tuple,
                            cfg_scale: float) -> None:
    """Refuse, before any model is built, a layout that does not divide the world, the model or the
    items' tokens; ``shape``: one item's latent ``(C, [T,] H, W)``."""
    if p.cfg_parallel not in (1, 2):
        raise ConfigError(f"parallel.cfg_parallel={p.cfg_parallel}: guidance has two halves; use 1 or 2")
    if p.cfg_parallel == 2 and cfg_scale == 1.0:
        raise ConfigError("parallel.cfg_parallel=2 with --cfg-scale 1: there is no unconditional half to run; "
                          "raise --cfg-scale or set parallel.cfg_parallel=1")
    if p.expert_model_parallel_size > 1:
        raise ConfigError(f"parallel.expert_model_parallel_size={p.expert_model_parallel_size}: generation keeps an MoE "
                          "model's experts whole on every rank (ranks sharing items make different numbers of calls, "
                          "which expert all-to-alls cannot span); use 1")
    if p.fsdp != "none" or p.overlap_grad_reduce or p.overlap_param_gather or p.tp_comm_overlap:
        raise ConfigError("parallel.fsdp / overlap_grad_reduce / overlap_param_gather / tp_comm_overlap are "
                          "training settings; generation layouts use TP, CP, PP, cfg_parallel and data parallel")
    _check_pipefusion(p, model_config)
    p = p.staged()
    dp = p.data_parallel_size(world_size)
    if dp % p.cfg_parallel:
        raise ConfigError(f"world size {world_size} leaves {dp} data-parallel ranks after TP x CP x PP = "
                          f"{p.model_parallel_size()}, not divisible by parallel.cfg_parallel={p.cfg_parallel}; "
                          "change the number of processes or the layout")
    frames = shape[1] if len(shape) == 4 else 1
    pt = getattr(model_config, "patch_size_t", 1) or 1
    # The training check on an equivalent dense batch (frames for the ST-DiT's frame split; the
    # interleaved pipeline splits every call into PP micro-batches, PipelinedForward pads them).
    data = DataConfig(name="moving_digits" if len(shape) == 4 else "mock", image_size=model_config.input_size,
                      video_frames=frames, global_batch_size=dp * p.pipeline_model_parallel_size, micro_batch_size=1)
    check_layout(p, model_config, data, world_size)
    tokens = (frames // pt) * (shape[-2] // model_config.patch_size) * (shape[-1] // model_config.patch_size)
    shards = p.token_shards()
    if tokens % shards:
        raise ConfigError(f"an item of {'x'.join(map(str, shape[1:]))} latents has {tokens} tokens, not a multiple "
                          f"of the {shards} ranks the sequence is split over (context_parallel_size x TP under "
                          "sequence_parallel); change --height/--width/--frames or the layout")
    if tokens % (p.patches() * shards):
        split = f" of {shards} ranks' pieces each (the sequence split)" if shards > 1 else ""
        raise ConfigError(f"PipeFusion's {p.patches()} patches (parallel.pipefusion_patches; 0: one per stage of "
                          f"parallel.pipefusion): an item of {'x'.join(map(str, shape[1:]))} "
                          f"latents has {tokens} tokens, which do not split into {p.patches()} equal patches{split}; "
                          "choose patches whose count times the sequence split divides the token count")


def _check_pipefusion(p: GenerateParallel, model_config) -> None:
    if p.pipefusion < 1 or p.pipefusion_patches < 0 or p.pipefusion_warmup_steps < 1:
        raise ConfigError(f"parallel.pipefusion={p.pipefusion}, pipefusion_patches={p.pipefusion_patches}, "
                          f"pipefusion_warmup_steps={p.pipefusion_warmup_steps}: stages and warm-up steps must be "
                          ">= 1 and patches >= 0 (0: one per stage)")
    if p.pipefusion > 1 and p.patches() == 1:
        raise ConfigError(f"parallel.pipefusion={p.pipefusion} with pipefusion_patches=1: one patch is a plain "
                          "pipeline; use pipeline_model_parallel_size, or 2+ patches (0: one per stage)")
    if p.patches() == 1:
        return
    pp = p.pipeline_model_parallel_size
    if pp > 1 and pp != p.pipefusion:
        raise ConfigError(f"parallel.pipefusion={p.pipefusion} with pipeline_model_parallel_size={pp}: PipeFusion's "
                          "stages are the pipeline; set parallel.pipefusion only")
    if p.virtual_pipeline_model_parallel_size:
        raise ConfigError("parallel.pipefusion runs one chunk per stage; unset virtual_pipeline_model_parallel_size")
    if p.hierarchical_context_parallel_sizes and getattr(model_config, "spatial_temporal", False):
        raise ConfigError("parallel.hierarchical_context_parallel_sizes picks the ST-DiT's two-level mesh, which "
                          "PipeFusion does not run (its displaced layers gather every rank's keys and values); unset "
                          "it: PipeFusion with context_parallel_size samples the ST-DiT on its DSP path")


@dataclass
class SamplingGroups:
    """This rank's place in a generation layout."""

    cfg_group: Optional[object]
    """The two ranks of its CFG pair (None without CFG-parallel)."""
    cfg_rank: int
    items_rank: int
    items_size: int
    writes: bool
    """Whether this rank writes its items' files: the first rank of its model replica and CFG pair."""


def sampling_groups(p: GenerateParallel) -> SamplingGroups:
    """Build the CFG pairs (every rank takes part in creating every group, as torch requires) and
    place this rank. megatron's groups must exist already."""
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    cfg_group = None
    if p.cfg_parallel > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, dist.get_process_group_ranks(dp_group))
        for ranks in sorted({tuple(r) for r in everyone}):
            for i in range(0, len(ranks), p.cfg_parallel):
                group = dist.new_group(list(ranks[i:i + p.cfg_parallel]))
                if dist.get_rank() in ranks[i:i + p.cfg_parallel]:
                    cfg_group = group
    model_rank_zero = (parallel_state.get_tensor_model_parallel_rank() == 0
                       and parallel_state.get_context_parallel_rank() == 0
                       and parallel_state.is_pipeline_first_stage())
    cfg_rank = dp_rank % p.cfg_parallel
    return SamplingGroups(cfg_group=cfg_group, cfg_rank=cfg_rank, items_rank=dp_rank // p.cfg_parallel,
                          items_size=dp_size // p.cfg_parallel, writes=model_rank_zero and cfg_rank == 0)
