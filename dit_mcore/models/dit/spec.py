"""ModuleSpec of the adaLN-Zero DiT layer."""
from __future__ import annotations

import logging
from typing import Optional

from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from dit_mcore.models.aten_linear import AtenColumnParallelLinear
from dit_mcore.models.core_attention import KernelsCoreAttention, SpatialCoreAttention, TemporalCoreAttention
from dit_mcore.models.cross_attention import HeadRMSNorm, TextCrossAttention, TextCrossAttentionSubmodules
from dit_mcore.models.dit.layer import DiTLayer, DiTLayerSubmodules
from dit_mcore.models.moe import moe_spec
from dit_mcore.models.st_attention import STSelfAttention
from dit_mcore.models.specs import linears, norm_spec

log = logging.getLogger(__name__)
_SAID: set[str] = set()


def dit_layer_spec(backend: str = "local", norm: str = "layernorm", num_moe_experts: Optional[int] = None,
                   moe_grouped_gemm: bool = False, cross_attention: bool = False, qk_norm: bool = False,
                   cross_attention_adaln: bool = True, spatial_temporal: bool = False,
                   float8_recipe: Optional[str] = None, te_fp8: bool = False) -> ModuleSpec:
    """Spec of one adaLN-Zero DiT layer. ``backend``: ``"local"`` or ``"auto"`` (megatron's local
    linears) or ``"te"`` (Transformer Engine's; local, with a log line, where TE does not load);
    ``norm``: ``"layernorm"`` (the paper's) or
    ``"rmsnorm"``, both without affine parameters (modulation replaces them); ``num_moe_experts``:
    megatron's ``MoELayer`` (top-k router, token dispatcher, experts) instead of the MLP;
    ``cross_attention``: attention to the text after self-attention, modulated and gated when
    ``cross_attention_adaln`` (NeMo's DiT), else on an affine norm of ``norm``'s kind and added to the
    residual (MovieGen); ``qk_norm``: per-head RMSNorm of queries and keys in every attention;
    ``spatial_temporal``: self-attention within each frame, then across frames (ST-DiT);
    ``float8_recipe``: the attention and MLP linears multiply in float8 (torchao; "tensorwise" or
    "rowwise"); ``te_fp8``: Transformer Engine's FP8 runs the layers, so TE's linears or an error (the
    text's K/V projection excepted: a bf16 local linear)."""
    column, row = linears(backend, float8_recipe, te_required=te_fp8)
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row))
    if num_moe_experts:
        mlp = moe_spec(column, num_moe_experts, grouped_gemm=moe_grouped_gemm)
    line = (f"DiT layer spec: {column.__name__} linears, {norm}, kernels core attention"
            + (", spatial then temporal self-attention" if spatial_temporal else "")
            + (", cross-attention" if cross_attention else "") + (", QK RMSNorm" if qk_norm else "")
            + (f", MoE with {num_moe_experts} experts" if num_moe_experts else ""))
    if line not in _SAID:  # once per process (the model and its EMA shadow build the same layers)
        _SAID.add(line)
        log.info("%s", line)
    head_norm = HeadRMSNorm if qk_norm else None
    cross = ModuleSpec(
        module=TextCrossAttention, params={"attn_mask_type": AttnMaskType.no_mask},
        # Under TE's FP8 the text's K/V projection stays a bf16 local linear: its rows are the batch's text
        # tokens, of any count, where TE's FP8 GEMMs need multiples of 16 (and it is a small GEMM).
        submodules=TextCrossAttentionSubmodules(linear_q=column, linear_kv=AtenColumnParallelLinear if te_fp8 else column,
                                                core_attention=KernelsCoreAttention,
                                                linear_proj=row, q_layernorm=head_norm, k_layernorm=head_norm))

    def self_attention(core):
        return ModuleSpec(module=STSelfAttention if spatial_temporal else SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
                          submodules=SelfAttentionSubmodules(linear_qkv=column, core_attention=core, linear_proj=row,
                                                             q_layernorm=head_norm, k_layernorm=head_norm))
    return ModuleSpec(
        module=DiTLayer,
        submodules=DiTLayerSubmodules(
            self_attention=self_attention(SpatialCoreAttention if spatial_temporal else KernelsCoreAttention),
            temporal_attention=self_attention(TemporalCoreAttention) if spatial_temporal else None,
            mlp=mlp,
            norm=norm_spec(norm, affine=False),
            cross_attention=cross if cross_attention else None,
            cross_attention_norm=norm_spec(norm, affine=True) if cross_attention and not cross_attention_adaln
            else None,
        ),
    )
