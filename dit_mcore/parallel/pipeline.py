"""Calling a pipelined model outside training: a forward-only run of megatron's schedule whose
output (the last stage's) reaches every rank, so samplers and previews need not know about stages."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func


class PipelinedForward:
    """``model(tokens, timesteps, labels, batch=..., grid=...)`` over all pipeline stages: every rank
    of the pipeline calls it with the same arguments and gets the whole model's output
    ``[s, b, out_patch_dim]``. Without pipeline parallelism it is the model itself."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, tokens: torch.Tensor, timesteps: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                 batch=None, grid=None) -> torch.Tensor:
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return self.model(tokens, timesteps, labels, batch=batch, grid=grid)
        config, model = self.model.config, self.model
        dtype = next(model.parameters()).dtype  # an fp32 EMA copy of a bf16 run sends fp32 activations

        def step(_data, chunk):
            out = chunk(tokens.to(dtype), timesteps, labels, batch=batch, grid=grid)
            return out, lambda output, non_loss_data=False: output

        s, b = tokens.shape[:2]
        saved_dtype, config.pipeline_dtype = config.pipeline_dtype, dtype
        try:
            store = get_forward_backward_func()(
                forward_step_func=step, data_iterator=None, model=[model], num_microbatches=1,
                seq_length=model.token_shard.padded(s), micro_batch_size=b, forward_only=True,
                collect_non_loss_data=True)
        finally:
            config.pipeline_dtype = saved_dtype
        if parallel_state.is_pipeline_last_stage():
            out = store[0].contiguous()
        else:
            out = torch.empty((s, b, config.out_patch_dim), dtype=dtype, device=tokens.device)
        dist.broadcast(out, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
        return out
