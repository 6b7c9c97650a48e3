"""The adaLN-Zero DiT layer: a megatron-core ``TransformerLayer`` whose norms are modulated by a
per-sample conditioning vector.

Conditioning is a first-class argument (:class:`Conditioning`), never smuggled through
``attention_mask``. Modulation is computed per *sample* and broadcast to that sample's tokens, so a
packed sequence gives every sample its own timestep.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch import nn


@dataclass
class Conditioning:
    """Per-sample conditioning and the token -> sample map.

    ``emb`` is ``[n, hidden]``. Dense batches (``[s, b, h]`` hidden states, ``n == b``) leave
    ``token_to_sample`` as None; packed THD batches (``[t, 1, h]``) give ``token_to_sample [t]``
    (padding tokens point at any valid sample: their outputs are masked out of the loss).
    """

    emb: torch.Tensor
    token_to_sample: Optional[torch.Tensor] = None

    def broadcast(self, per_sample: torch.Tensor) -> torch.Tensor:
        """``[n, k]`` -> a tensor broadcastable against ``[s, b, k]`` hidden states."""
        if self.token_to_sample is None:
            return per_sample.unsqueeze(0)
        return per_sample[self.token_to_sample].unsqueeze(1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class AdaLNModulation(nn.Module):
    """``SiLU -> Linear(hidden, chunks*hidden)``, zero-initialised so every layer starts as the
    identity (the "Zero" in adaLN-Zero). Replicated across tensor-parallel ranks: its input, the
    conditioning vector, is the same on all of them."""

    def __init__(self, hidden_size: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(hidden_size, chunks * hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, cond: Conditioning) -> list[torch.Tensor]:
        mod = self.linear(nn.functional.silu(cond.emb))
        return list(cond.broadcast(mod).chunk(self.chunks, dim=-1))


@dataclass
class DiTLayerSubmodules:
    """Specs of the attention and MLP inside a DiT layer."""

    self_attention: ModuleSpec
    mlp: ModuleSpec


class DiTLayer(TransformerLayer):
    """``x += gate_a * Attn(modulate(LN(x)))``; ``x += gate_m * MLP(modulate(LN(x)))``.

    The megatron ``TransformerLayer`` builds the attention and MLP from the spec (so TP, TE and
    recompute settings apply); its norm slots are identities because DiT's norms have no affine
    parameters and are modulated instead.
    """

    def __init__(self, config, submodules: DiTLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection=None, vp_stage=None):
        super().__init__(config=config,
                         submodules=TransformerLayerSubmodules(
                             input_layernorm=IdentityOp, self_attention=submodules.self_attention,
                             pre_mlp_layernorm=IdentityOp, mlp=submodules.mlp),
                         layer_number=layer_number, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, elementwise_affine=False)
        self.adaLN_modulation = AdaLNModulation(config.hidden_size, chunks=6)

    def forward(self, hidden_states: torch.Tensor, conditioning: Conditioning, packed_seq_params=None):
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaLN_modulation(conditioning)
        attn_out, attn_bias = self.self_attention(
            modulate(self.norm(hidden_states), shift_a, scale_a), attention_mask=None,
            packed_seq_params=packed_seq_params)
        if attn_bias is not None:
            attn_out = attn_out + attn_bias
        hidden_states = hidden_states + gate_a * attn_out
        mlp_out, mlp_bias = self.mlp(modulate(self.norm(hidden_states), shift_m, scale_m))
        if mlp_bias is not None:
            mlp_out = mlp_out + mlp_bias
        return hidden_states + gate_m * mlp_out
