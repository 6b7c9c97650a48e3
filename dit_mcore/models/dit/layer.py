"""The adaLN-Zero DiT layer: a megatron-core ``TransformerLayer`` whose norms are modulated by a
per-sample conditioning vector (see :mod:`dit_mcore.models.modulation`), optionally with
cross-attention to text between self-attention and the MLP (the cross-attention DiT, and MovieGen's
Llama DiT with its plain-residual cross-attention)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from dit_mcore.models.modulation import AdaLNModulation, Conditioning
from dit_mcore.models.recompute import over_chunks, recomputed


@dataclass
class DiTLayerSubmodules:
    """Specs of the parts of a DiT layer."""

    self_attention: ModuleSpec
    mlp: ModuleSpec
    norm: ModuleSpec
    """The (modulated) norm before attention and before the MLP, built as
    ``norm(hidden_size, eps=layernorm_epsilon)``: DiT uses a LayerNorm without affine parameters."""
    cross_attention: Optional[ModuleSpec] = None
    """Cross-attention to the text (``TextCrossAttention``); None: the class-conditional layer."""
    temporal_attention: Optional[ModuleSpec] = None
    """ST-DiT: self-attention across frames, after ``self_attention`` (then within each frame);
    modulated and gated like it (three more adaLN chunks)."""
    cross_attention_norm: Optional[ModuleSpec] = None
    """None: the cross-attention input is adaLN-modulated and its output gated (NeMo's DiT); a norm
    spec (affine): cross-attention reads that norm of the stream and its output is added to the
    residual as it is (MovieGen's Llama DiT)."""


class DiTLayer(TransformerLayer):
    """``x += gate_a * Attn(modulate(norm(x)))``; ``x += gate_m * MLP(modulate(norm(x)))``; with
    cross-attention, ``x += gate_c * CrossAttn(modulate(norm(x)), text)`` between the two (nine
    adaLN chunks instead of six, as NeMo's cross-attention DiT; zero gates keep the identity init),
    or with a ``cross_attention_norm``, ``x += CrossAttn(cross_norm(x), text)`` (MovieGen, six chunks).
    The ST-DiT splits self-attention into spatial then temporal attention, each modulated and gated.

    The megatron ``TransformerLayer`` builds the attention and MLP from the spec (so TP, TE and
    selective recompute of the core attention apply); its own norm slots are identities because
    DiT's norms are modulated instead.
    """

    def __init__(self, config, submodules: DiTLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection=None, vp_stage=None):
        super().__init__(config=config,
                         submodules=TransformerLayerSubmodules(
                             input_layernorm=IdentityOp, self_attention=submodules.self_attention,
                             cross_attention=submodules.cross_attention or IdentityOp,
                             pre_mlp_layernorm=IdentityOp, mlp=submodules.mlp),
                         layer_number=layer_number, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.norm = build_module(submodules.norm, config.hidden_size, eps=config.layernorm_epsilon)
        self.has_cross_attention = submodules.cross_attention is not None
        self.cross_norm = None
        if submodules.cross_attention_norm is not None:
            self.cross_norm = build_module(submodules.cross_attention_norm, config.hidden_size,
                                           eps=config.layernorm_epsilon)
        self.temporal_attention = None
        if submodules.temporal_attention is not None:
            cp_type = config.cp_comm_type if config.context_parallel_size > 1 else None
            self.temporal_attention = build_module(submodules.temporal_attention, config=config,
                                                   layer_number=self.layer_number, pg_collection=pg_collection,
                                                   **({"cp_comm_type": cp_type} if cp_type else {}))
        modulated_cross = self.has_cross_attention and self.cross_norm is None
        chunks = 6 + 3 * modulated_cross + 3 * (self.temporal_attention is not None)
        self.adaLN_modulation = AdaLNModulation(config.hidden_size, chunks=chunks, lora_rank=config.adaln_lora_rank)
        selective = (config.recompute_modules or ()) if config.recompute_granularity == "selective" else ()
        self.recompute_mlp = "mlp" in selective
        self.recompute_norm = "layernorm" in selective

    def forward(self, hidden_states: torch.Tensor, conditioning: Conditioning, *,
                context: Optional[torch.Tensor] = None, context_params=None,
                rotary_pos_emb: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """``context``: the embedded text ``[L, 1, hidden]``, with ``context_params`` (its
        cross-attention segments) -- required with cross-attention, refused without."""
        if (context is not None) != self.has_cross_attention:
            raise ValueError("this layer has cross-attention: pass the embedded text as context" if context is None
                             else "the adaLN-Zero DiT layer has no cross-attention; pass context=None "
                                  "(use model.family=dit_xattn for text)")
        chunks = self.adaLN_modulation(conditioning)
        shift_a, scale_a, gate_a = chunks[:3]
        shift_m, scale_m, gate_m = chunks[-3:]
        router = getattr(self.mlp, "router", None)
        if router is not None:  # MoE: the load-balancing loss is weighted per sample, like the loss
            router.samples = conditioning.emb.shape[0]
        hidden_states = self._attend(self.self_attention, hidden_states, conditioning, shift_a, scale_a, gate_a,
                                     rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)
        if self.temporal_attention is not None:
            hidden_states = self._attend(self.temporal_attention, hidden_states, conditioning, *chunks[3:6],
                                         rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)
            chunks = chunks[3:]  # the cross-attention's chunks follow
        if context is not None and self.cross_norm is not None:
            out, bias = self.cross_attention(self.cross_norm(hidden_states), attention_mask=None,
                                             key_value_states=context, packed_seq_params=context_params)
            hidden_states = hidden_states + (out if bias is None else out + bias)
        elif context is not None:
            hidden_states = self._attend(self.cross_attention, hidden_states, conditioning, *chunks[3:6],
                                         key_value_states=context, packed_seq_params=context_params)
        if self.config.chunk_tokens and self.training and torch.is_grad_enabled():
            return over_chunks(self._mlp_residual, hidden_states, conditioning, shift_m, scale_m, gate_m,
                               chunk=self.config.chunk_tokens, config=self.config)
        if self.recompute_mlp and self.training and torch.is_grad_enabled():
            mlp_out = recomputed(self._mlp_branch(conditioning), hidden_states, shift_m, scale_m,
                                 config=self.config, traceable=router is None)
        else:
            normed, recompute = self._modulated_norm(hidden_states, conditioning, shift_m, scale_m)
            out, bias = self.mlp(normed)
            mlp_out = recompute(out if bias is None else out + bias)
        return conditioning.gated_add(hidden_states, gate_m, mlp_out)

    def attention_input(self, hidden_states: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """What this layer's self-attention reads, ``modulate(norm(x))`` with its first shift and scale
        (TeaCache's indicator, :mod:`dit_mcore.generate.cache`)."""
        shift, scale = self.adaLN_modulation(conditioning)[:2]
        return conditioning.modulate(self.norm(hidden_states), shift, scale)

    def _attend(self, attention, hidden_states, conditioning: Conditioning, shift, scale, gate, **kwargs):
        """``x + gate * attention(modulate(norm(x)))`` (self- or cross-attention)."""
        normed, recompute = self._modulated_norm(hidden_states, conditioning, shift, scale)
        out, bias = attention(normed, attention_mask=None, **kwargs)
        return conditioning.gated_add(hidden_states, gate, recompute(out if bias is None else out + bias))

    def _modulated_norm(self, hidden_states, conditioning: Conditioning, shift, scale):
        """``(modulate(norm(x)), after)``; ``after(y)`` returns ``y``, the output of the sublayer that
        reads the normed input. Under selective recompute of ``"layernorm"`` (megatron's
        ``CheckpointWithoutOutput``) ``after`` frees the normed tensor, which the sublayer's first
        linear saved for its weight gradient, and has it recomputed when the backward reaches ``y``:
        one ``[tokens, hidden]`` activation less per sublayer."""
        if not (self.recompute_norm and self.training and torch.is_grad_enabled()):
            return conditioning.modulate(self.norm(hidden_states), shift, scale), lambda y: y
        # fp8=None: megatron turns its default (False) into True and would then need Transformer Engine.
        checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
        normed = checkpoint.checkpoint(lambda x, sh, sc: conditioning.modulate(self.norm(x), sh, sc),
                                       hidden_states, shift, scale)

        def after(y):
            checkpoint.discard_output_and_register_recompute(y)
            return y
        return normed, after

    def _mlp_residual(self, hidden_states, conditioning: Conditioning, shift, scale, gate):
        """``x + gate * MLP(modulate(norm(x)))`` (one chunk of tokens, under ``chunk_tokens``)."""
        return conditioning.gated_add(hidden_states, gate, self._mlp_branch(conditioning)(hidden_states, shift, scale))

    def _mlp_branch(self, conditioning: Conditioning):
        def branch(hidden_states, shift, scale):
            out, bias = self.mlp(conditioning.modulate(self.norm(hidden_states), shift, scale))
            return out if bias is None else out + bias
        return branch
