"""Exponential moving average of the model weights (a frozen copy of the module)."""
from __future__ import annotations

import torch

from dit_mcore.parallel.fsdp import publish_weights, sharded_parameters, to_shards


class EMA:
    """``ema = decay * ema + (1 - decay) * param`` after every optimizer step. The shadow is a full
    module (same tensor-parallel shards as the model), so it samples and checkpoints like one.

    ``shadow`` is a freshly built module of the same architecture (megatron modules hold process
    groups and cannot be deep-copied); it starts as a copy of ``model``'s weights.
    """

    def __init__(self, model: torch.nn.Module, shadow: torch.nn.Module, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"trainer.ema_decay must be in [0, 1), got {decay}")
        self.decay = decay
        to_shards((model, shadow))
        shadow.load_state_dict(model.state_dict())
        publish_weights(shadow)
        self.module = shadow.eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
            if p.dtype != torch.float32:  # (an FSDP-sharded shadow is made fp32 before sharding)
                p.data = p.data.float()

    def decay_at(self, step: int) -> float:
        """Warmed-up decay ``min(decay, (1 + step) / (10 + step))``: early on the average follows the
        model closely instead of remembering the (zero-output) initialisation for thousands of
        steps, which matters for short runs and changes nothing for long ones."""
        return min(self.decay, (1.0 + step) / (10.0 + step))

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        """Fold in the weights after optimizer step ``step`` (0-based): one foreach lerp over all
        parameters (a few fused kernels on GPU instead of one launch per parameter), in fp32. Under
        FSDP on this rank's shards; Megatron-FSDP's shadow weight buffers are refreshed only when the
        shadow is called (``fsdp.forward_view``), not every step."""
        shadow = sharded_parameters(self.module)
        params = [p.detach().float() for p in sharded_parameters(model)]
        if len(params) != len(shadow):
            raise ValueError(f"EMA.update: the model has {len(params)} parameters but the EMA shadow {len(shadow)}; "
                             "pass the model the EMA was built for")
        torch._foreach_lerp_(shadow, params, 1.0 - self.decay_at(step))
