"""The adaLN-Zero DiT layer: a megatron-core ``TransformerLayer`` whose norms are modulated by a
per-sample conditioning vector (see :mod:`dit_mcore.models.modulation`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from dit_mcore.models.modulation import AdaLNModulation, Conditioning


@dataclass
class DiTLayerSubmodules:
    """Specs of the parts of a DiT layer."""

    self_attention: ModuleSpec
    mlp: ModuleSpec
    norm: ModuleSpec
    """The (modulated) norm before attention and before the MLP, built as
    ``norm(hidden_size, eps=layernorm_epsilon)``: DiT uses a LayerNorm without affine parameters."""


class DiTLayer(TransformerLayer):
    """``x += gate_a * Attn(modulate(norm(x)))``; ``x += gate_m * MLP(modulate(norm(x)))``.

    The megatron ``TransformerLayer`` builds the attention and MLP from the spec (so TP, TE and
    selective recompute of the core attention apply); its own norm slots are identities because
    DiT's norms are modulated instead.
    """

    def __init__(self, config, submodules: DiTLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection=None, vp_stage=None):
        super().__init__(config=config,
                         submodules=TransformerLayerSubmodules(
                             input_layernorm=IdentityOp, self_attention=submodules.self_attention,
                             pre_mlp_layernorm=IdentityOp, mlp=submodules.mlp),
                         layer_number=layer_number, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.norm = build_module(submodules.norm, config.hidden_size, eps=config.layernorm_epsilon)
        self.adaLN_modulation = AdaLNModulation(config.hidden_size, chunks=6)
        self.recompute_mlp = (config.recompute_granularity == "selective"
                              and "mlp" in (config.recompute_modules or ()))

    def forward(self, hidden_states: torch.Tensor, conditioning: Conditioning, *,
                context: Optional[torch.Tensor] = None, rotary_pos_emb: Optional[torch.Tensor] = None,
                packed_seq_params=None) -> torch.Tensor:
        if context is not None:
            raise ValueError("the adaLN-Zero DiT layer has no cross-attention; pass context=None "
                             "(use a text-conditioned family for text)")
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaLN_modulation(conditioning)
        router = getattr(self.mlp, "router", None)
        if router is not None:  # MoE: the load-balancing loss is weighted per sample, like the loss
            router.samples = conditioning.emb.shape[0]
        attn_out, attn_bias = self.self_attention(
            conditioning.modulate(self.norm(hidden_states), shift_a, scale_a), attention_mask=None,
            rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)
        if attn_bias is not None:
            attn_out = attn_out + attn_bias
        hidden_states = conditioning.gated_add(hidden_states, gate_a, attn_out)
        if self.recompute_mlp and self.training and torch.is_grad_enabled():
            mlp_out = tensor_parallel.checkpoint(self._mlp_branch(conditioning), False, hidden_states,
                                                 shift_m, scale_m)
        else:
            mlp_out = self._mlp_branch(conditioning)(hidden_states, shift_m, scale_m)
        return conditioning.gated_add(hidden_states, gate_m, mlp_out)

    def _mlp_branch(self, conditioning: Conditioning):
        def branch(hidden_states, shift, scale):
            out, bias = self.mlp(conditioning.modulate(self.norm(hidden_states), shift, scale))
            return out if bias is None else out + bias
        return branch
