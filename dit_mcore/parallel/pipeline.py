"""A rank's pipeline chunks as one module, and calling a pipelined model outside training.

Under pipeline parallelism a rank holds one model chunk per virtual stage (one without VPP).
:class:`ModelChunks` keeps them together for the EMA, checkpoints and the optimizer;
:class:`PipelinedForward` runs megatron's schedule forward-only and hands the last stage's output
to every rank, so samplers and previews need not know about stages.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import nn

from dit_mcore.models.seeding import draw_base_seed


class ModelChunks(nn.ModuleList):
    """This rank's model chunks in virtual-stage order; state-dict keys are ``<chunk>.<name>``."""

    @classmethod
    def build(cls, build_chunk: Callable[..., nn.Module], vpp: Optional[int],
              seed: Optional[int] = None) -> "ModelChunks":
        """``build_chunk(pre_process=, post_process=, vp_stage=, init_seed=)`` for each virtual stage of
        this rank; all chunks share one init seed (drawn from the caller's RNG unless given, and kept
        as ``init_seed``), so their parts start as in a one-process model."""
        seed = draw_base_seed() if seed is None else seed
        if not vpp or vpp == 1:
            chunks = cls([build_chunk(pre_process=parallel_state.is_pipeline_first_stage(),
                                      post_process=parallel_state.is_pipeline_last_stage(), vp_stage=None,
                                      init_seed=seed)])
        else:
            chunks = cls([build_chunk(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                                      post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                                      vp_stage=i, init_seed=seed) for i in range(vpp)])
        chunks.init_seed = seed
        return chunks

    @classmethod
    def of_family(cls, family, config, *, backend: str, device, dtype: torch.dtype,
                  seed: Optional[int] = None) -> "ModelChunks":
        """This rank's chunks of ``family`` (a model family, ``dit_mcore.models.get_family``) for its
        ``config``, built on ``device`` and cast to ``dtype``: what training and generation both build."""
        with torch.device(device):
            chunks = cls.build(lambda **stage: family.build(config, backend=backend, **stage),
                               config.virtual_pipeline_model_parallel_size, seed=seed)
        return chunks.to(dtype)

    @property
    def config(self):
        return self[0].config

    @property
    def token_shard(self):
        return self[0].token_shard

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Every chunk's sharded state (checkpoint keys are global: chunks reshard like stages)."""
        merged = {}
        for i, chunk in enumerate(self):
            part = chunk.sharded_state_dict(prefix, sharded_offsets, metadata)
            merged.update({f"{prefix}{i}.{key[len(prefix):]}": value for key, value in part.items()})
        return merged


class PipelinedForward:
    """``model(tokens, timesteps, labels, batch=..., grid=...)`` over all pipeline stages: every rank
    of the pipeline calls it with the same arguments and gets the whole model's output
    ``[s, b, out_patch_dim]``. Without pipeline parallelism it is the model itself."""

    def __init__(self, chunks: ModelChunks):
        self.chunks = chunks

    def __call__(self, tokens: torch.Tensor, timesteps: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                 batch=None, grid=None, context=None) -> torch.Tensor:
        chunks = self.chunks
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return chunks[0](tokens, timesteps, labels, batch=batch, grid=grid, context=context)
        config = chunks.config
        dtype = next(chunks.parameters()).dtype  # an fp32 EMA copy of a bf16 run sends fp32 activations
        s, b = tokens.shape[:2]
        # The interleaved schedule needs at least PP micro-batches: split a dense batch along its
        # samples (padded by repeating the last one).
        parts = 1 if len(chunks) == 1 else parallel_state.get_pipeline_model_parallel_world_size()
        if parts > 1 and batch is not None and batch.is_packed:
            raise NotImplementedError("forward-only calls of an interleaved pipeline take dense batches")
        per = -(-b // parts)
        order = list(range(b)) + [b - 1] * (per * parts - b)
        if per * parts != b:
            idx = torch.tensor(order, device=tokens.device)
            tokens, timesteps = tokens[:, idx], timesteps[idx]
            labels = None if labels is None else labels[idx]
        micro = [(tokens[:, j * per:(j + 1) * per], timesteps[j * per:(j + 1) * per],
                  None if labels is None else labels[j * per:(j + 1) * per],
                  None if context is None else context.take(order[j * per:(j + 1) * per])) for j in range(parts)]

        def step(data, chunk):
            x, t, y, text = next(data)
            out = chunk(x.to(dtype), t, y, batch=batch, grid=grid, context=text)
            return out, lambda output, non_loss_data=False: output

        saved_dtype, config.pipeline_dtype = config.pipeline_dtype, dtype
        try:
            store = get_forward_backward_func()(
                forward_step_func=step, data_iterator=[iter(micro) for _ in chunks], model=list(chunks),
                num_microbatches=parts, seq_length=chunks.token_shard.padded(s), micro_batch_size=per,
                forward_only=True, collect_non_loss_data=True)
        finally:
            config.pipeline_dtype = saved_dtype
        if parallel_state.is_pipeline_last_stage():
            out = torch.cat(list(store), dim=1).contiguous()
        else:
            out = torch.empty((s, per * parts, config.out_patch_dim), dtype=dtype, device=tokens.device)
        dist.broadcast(out, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
        return out[:, :b]
