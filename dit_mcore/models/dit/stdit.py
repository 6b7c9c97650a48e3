"""The spatial-temporal DiT (``model.family=stdit``): each layer attends within each frame, then
across the frames at each position, then to the sample's text, then runs its MLP -- every
sub-block adaLN-modulated and gated (12 zero-init chunks: identity at init). Attention over a
whole video costs ``(T*S)^2``; the split costs ``T*S^2 + S*T^2``.

Under context parallel every rank holds a block of whole frames (dense video batches, frames
divisible by the CP size): spatial attention is local and temporal attention switches the sharded
dim with one all-to-all of q|k|v and one of the output (``kernels.spatial_temporal``, DSP's
dynamic switch). Same model classes as the DiT; this module is its presets."""
from dit_mcore.errors import ConfigError
from dit_mcore.models.dit.config import build_preset
from dit_mcore.models.adapter import image_model_fn, token_model_fn
from dit_mcore.models.dit.model import build_model
from dit_mcore.models.dit.spec import dit_layer_spec
from dit_mcore.models.dit.xattn import T5_XXL
from dit_mcore.models.family import ModelFamily
from dit_mcore.models.flops import dit_flops

_STDIT = dict(spatial_temporal=True, num_classes=0, class_dropout_prob=0.0, qk_layernorm=True, text_dim=T5_XXL,
              learn_sigma=False)
# name -> (layers, hidden, heads): the DiT paper's S and B widths, and OpenSora's STDiT-XL/2.
_SIZES = {"ST-DiT-S/2": (12, 384, 6), "ST-DiT-B/2": (12, 768, 12), "ST-DiT-XL/2": (28, 1152, 16)}


def _presets() -> dict:
    table = {name: dict(_STDIT, num_layers=layers, hidden_size=hidden, num_attention_heads=heads, patch_size=2,
                        in_channels=4, input_size=32)
             for name, (layers, hidden, heads) in _SIZES.items()}
    table["stdit-tiny"] = dict(_STDIT, num_layers=2, hidden_size=64, num_attention_heads=4, patch_size=2,
                               input_size=8, in_channels=4, text_dim=32)
    # The CPU text-to-video demo's size: 16x16 grey frames, 4x4 patches, the tiny text encoder's 32-wide text.
    table["stdit-moving-digits"] = dict(_STDIT, num_layers=4, hidden_size=128, num_attention_heads=4, patch_size=4,
                                        input_size=16, in_channels=1, text_dim=32)
    return table


PRESETS = _presets()


def preset(name: str, **overrides):
    """An ST-DiT ``DiTConfig`` from a preset of :data:`PRESETS`."""
    config = build_preset(PRESETS, name, overrides, family="stdit")
    if not config.spatial_temporal:
        raise ConfigError("model.spatial_temporal=False: the ST-DiT's layers are spatial-temporal; use "
                          "model.family=dit_xattn for full attention")
    return config


FAMILY = ModelFamily(
    name="stdit", presets=lambda: PRESETS, make_config=preset, layer_spec=dit_layer_spec, build=build_model,
    token_model_fn=token_model_fn, image_model_fn=image_model_fn, conditioning=("labels", "text"), flops=dit_flops)
