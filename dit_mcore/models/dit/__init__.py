"""The adaLN-Zero DiT family (``model.family=dit``): class-conditional, image and video latents."""
from dit_mcore.models.dit.config import PRESETS, preset
from dit_mcore.models.adapter import image_model_fn, token_model_fn
from dit_mcore.models.dit.layer import DiTLayer, DiTLayerSubmodules
from dit_mcore.models.dit.model import DiT, FinalLayer, build_model
from dit_mcore.models.dit.spec import dit_layer_spec
from dit_mcore.models.family import ModelFamily
from dit_mcore.models.flops import dit_flops


def _interop() -> dict:
    from dit_mcore.models.dit.interop import (export_diffusers, export_facebookresearch, load_diffusers,
                                              load_facebookresearch)
    return {"diffusers": (load_diffusers, export_diffusers),
            "facebookresearch": (load_facebookresearch, export_facebookresearch)}


FAMILY = ModelFamily(
    name="dit", presets=lambda: PRESETS, make_config=preset, layer_spec=dit_layer_spec, build=build_model,
    token_model_fn=token_model_fn, image_model_fn=image_model_fn, interop=_interop,
    conditioning=("labels",), flops=dit_flops)

__all__ = ["DiT", "DiTLayer", "DiTLayerSubmodules", "FinalLayer", "build_model", "dit_layer_spec", "FAMILY"]
