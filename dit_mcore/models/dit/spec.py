"""ModuleSpec of the adaLN-Zero DiT layer."""
from __future__ import annotations

import logging

from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from dit_mcore.models.core_attention import KernelsCoreAttention
from dit_mcore.models.dit.layer import DiTLayer, DiTLayerSubmodules
from dit_mcore.models.specs import linears, norm_spec

log = logging.getLogger(__name__)


def dit_layer_spec(backend: str = "local", norm: str = "layernorm") -> ModuleSpec:
    """Spec of one adaLN-Zero DiT layer. ``backend``: ``"local"``, ``"te"`` or ``"auto"`` (TE linears
    when installed on a GPU, else local, with a log line); ``norm``: ``"layernorm"`` (the paper's) or
    ``"rmsnorm"``, both without affine parameters (modulation replaces them)."""
    column, row = linears(backend)
    log.info("DiT layer spec: %s linears, %s, kernels core attention", column.__name__, norm)
    return ModuleSpec(
        module=DiTLayer,
        submodules=DiTLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(linear_qkv=column, core_attention=KernelsCoreAttention,
                                                   linear_proj=row)),
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
            norm=norm_spec(norm, affine=False),
        ),
    )
