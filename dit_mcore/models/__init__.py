"""Model families built from megatron-core ModuleSpecs, reached through :mod:`.registry`.

Shared pieces live beside the families: :mod:`.modulation` (per-sample adaLN), :mod:`.embeddings`,
:mod:`.layer_stack` (what megatron's TransformerBlock owns), :mod:`.core_attention` (attention
through ``kernels``), :mod:`.specs` (linear/norm choice), :mod:`.adapter` (model <-> objective).
"""
from dit_mcore.models.modulation import Conditioning
from dit_mcore.models.family import ModelFamily
from dit_mcore.models.registry import families, get_family


def __getattr__(name):
    # The DiT family's names, imported lazily so that importing the registry never pulls a family.
    if name in ("DiT", "DiTLayer", "build_model"):
        import dit_mcore.models.dit as dit
        return getattr(dit, name)
    raise AttributeError(name)


__all__ = ["Conditioning", "ModelFamily", "families", "get_family", "DiT", "DiTLayer", "build_model"]
