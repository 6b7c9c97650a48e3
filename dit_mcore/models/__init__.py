"""DiT model families built from megatron-core ModuleSpecs."""
from dit_mcore.models.dit import DiT, build_model
from dit_mcore.models.dit_layer import Conditioning, DiTLayer
from dit_mcore.models.patching import patchify, unpatchify

__all__ = ["DiT", "DiTLayer", "Conditioning", "build_model", "patchify", "unpatchify"]
