"""The cross-attention DiT family (``model.family=dit_xattn``, NeMo's main video model): the
adaLN-Zero DiT whose layers also attend to their sample's text, with per-head QK RMSNorm, 3D
sin-cos positions for video grids, and text classifier-free guidance through a learned null text.
Labels still work alongside text when a preset sets ``num_classes``."""
from dit_mcore.errors import ConfigError
from dit_mcore.models.dit.config import _SIZES, build_preset
from dit_mcore.models.adapter import image_model_fn, token_model_fn
from dit_mcore.models.dit.model import build_model
from dit_mcore.models.dit.spec import dit_layer_spec
from dit_mcore.models.family import ModelFamily
from dit_mcore.models.flops import dit_flops

T5_XXL = 4096  # width of T5-XXL (and T5-11B) encoder states, the usual video-DiT text encoder
_TEXT = dict(num_classes=0, class_dropout_prob=0.0, qk_layernorm=True, text_dim=T5_XXL)
# Latent video models: 16-channel video latents (Cosmos / Wan tokenizers), 2x2 patches, no biases.
_VIDEO = dict(_TEXT, in_channels=16, patch_size=2, input_size=64, add_bias_linear=False, add_qkv_bias=False,
              learn_sigma=False)


def _presets() -> dict:
    table = {f"DiT-XAttn-{size}/2": dict(_TEXT, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                         patch_size=2)
             for size, (layers, hidden, heads) in _SIZES.items()}
    # NeMo's DiT7BConfig (32 layers, width 3072, 24 heads) and a 28B at width 5120.
    table["DiT-XAttn-7B"] = dict(_VIDEO, num_layers=32, hidden_size=3072, num_attention_heads=24)
    table["DiT-XAttn-28B"] = dict(_VIDEO, num_layers=42, hidden_size=5120, num_attention_heads=40)
    # NeMo's other DiT7BConfig (``cosmos_7b_text2world``): Cosmos-1.0's 7B, 28 layers of width 4096 with
    # AdaLN-LoRA of rank 256 and a 1024-wide text projection; the model of NeMo's published 7B rows.
    table["DiT-XAttn-7B-Cosmos"] = dict(_VIDEO, num_layers=28, hidden_size=4096, num_attention_heads=32,
                                        adaln_lora_rank=256, text_dim=1024, normalization="RMSNorm")
    table["xattn-tiny"] = dict(_TEXT, num_layers=2, hidden_size=64, num_attention_heads=4, patch_size=2,
                               input_size=8, in_channels=4, text_dim=32)
    # The CPU text-to-video demo: 16x16 grey frames, 4x4 patches, the tiny text encoder's 32-wide text.
    table["xattn-moving-digits"] = dict(_TEXT, num_layers=4, hidden_size=128, num_attention_heads=4, patch_size=4,
                                        input_size=16, in_channels=1, text_dim=32, learn_sigma=False)
    return table


PRESETS = _presets()


def build_text_preset(table: dict, name: str, overrides: dict, *, family: str):
    """``build_preset`` for a family whose every layer cross-attends to text: ``text_dim`` must be set."""
    config = build_preset(table, name, overrides, family=family)
    if config.text_dim <= 0:
        raise ConfigError(f"model.text_dim={config.text_dim}: model.family={family} cross-attends to text; set the "
                          "dataset's text width (its text encoder's dim, e.g. 4096 for T5-XXL)")
    return config


def preset(name: str, **overrides):
    """A cross-attention ``DiTConfig`` from a preset of :data:`PRESETS`."""
    return build_text_preset(PRESETS, name, overrides, family="dit_xattn")


FAMILY = ModelFamily(
    name="dit_xattn", presets=lambda: PRESETS, make_config=preset, layer_spec=dit_layer_spec, build=build_model,
    token_model_fn=token_model_fn, image_model_fn=image_model_fn, conditioning=("labels", "text"), flops=dit_flops)
