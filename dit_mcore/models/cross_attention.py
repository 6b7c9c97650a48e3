"""Cross-attention to text on megatron-core's ``CrossAttention``, and the per-head QK norm.

megatron's ``CrossAttention`` projects queries from the token stream and keys/values from the
context, both column-parallel (heads split over TP). Two things differ for DiT text:

- The text is whole on every rank, also under sequence parallel (it is short, and its length
  varies per sample, so it does not split evenly over TP): the K/V projection does not
  all-gather its input, and its input gradient is all-reduced over TP instead.
- Every head has its own keys and values, also in a grouped-query model (megatron's
  ``CrossAttention`` has no GQA; the text is short, so its K/V projection is cheap).
- Optional per-head RMSNorm of queries and keys (``qk_layernorm``, as NeMo's cross-attention DiT
  and most video DiTs use), which megatron has for self-attention only. The norms are named
  ``q_layernorm`` / ``k_layernorm``, so megatron's ``finalize_model_grads`` sums their gradients
  over TP ranks (each rank sees only its heads).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Union

from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn


class HeadRMSNorm(nn.RMSNorm):
    """RMSNorm over each head's channels, with megatron's norm constructor signature."""

    def __init__(self, hidden_size: int, config=None, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps, elementwise_affine=True)


@dataclass
class TextCrossAttentionSubmodules(CrossAttentionSubmodules):
    q_layernorm: Union[ModuleSpec, type, None] = None
    k_layernorm: Union[ModuleSpec, type, None] = None


class TextCrossAttention(CrossAttention):
    """Queries from the (possibly sequence-parallel) tokens, keys/values from the whole text."""

    def __init__(self, config, submodules: TextCrossAttentionSubmodules, layer_number: int, **kwargs):
        if config.num_query_groups not in (None, config.num_attention_heads):
            config = copy.copy(config)  # this attention only: one K/V head per query head
            config.num_query_groups = config.num_attention_heads
        super().__init__(config, submodules, layer_number, **kwargs)
        kv = self.linear_kv
        if kv.sequence_parallel:  # the text is not sequence-sharded: no gather, reduce dgrad over TP
            kv.sequence_parallel = False
            if hasattr(kv, "disable_grad_reduce"):  # megatron's local linear (TE's column-parallel one
                kv.allreduce_dgrad = not kv.disable_grad_reduce  # all-reduces dgrad itself without SP)
        norm = dict(hidden_size=self.hidden_size_per_attention_head, config=config, eps=config.layernorm_epsilon)
        self.q_layernorm = build_module(submodules.q_layernorm, **norm) if submodules.q_layernorm else None
        self.k_layernorm = build_module(submodules.k_layernorm, **norm) if submodules.k_layernorm else None

    def get_query_key_value_tensors(self, hidden_states, key_value_states, output_gate=False, split_qkv=True):
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                                output_gate=output_gate, split_qkv=split_qkv)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value
