"""The MovieGen-style Llama DiT (``model.family=llama``): the DiT's layers in Llama's form -- RMSNorm,
SwiGLU MLP, grouped-query attention, no linear biases -- with 3D rotary positions (each head's
channels split over time, height and width, built per token, so packed grids and context-parallel
pieces get their own angles), adaLN-modulated norms for the timestep, and cross-attention to the
text on an affine RMSNorm whose output is added to the residual (NeMo's ``MoviegGenLayer`` forgets
that add). Same model classes as the DiT; this module is its presets."""
import torch.nn.functional as F

from dit_mcore.models.adapter import image_model_fn, token_model_fn
from dit_mcore.models.dit.model import build_model
from dit_mcore.models.dit.spec import dit_layer_spec
from dit_mcore.models.dit.xattn import T5_XXL, build_text_preset
from dit_mcore.models.family import ModelFamily
from dit_mcore.models.flops import dit_flops

_LLAMA = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              add_qkv_bias=False, layernorm_epsilon=1e-5, position_embedding="rope3d", cross_attention_adaln=False,
              num_classes=0, class_dropout_prob=0.0, text_dim=T5_XXL, learn_sigma=False)
# Latent video: 16-channel latents, 2x2 patches (MovieGen's TAE has 16 channels).
_VIDEO = dict(_LLAMA, in_channels=16, patch_size=2, input_size=64)

# name -> (layers, hidden, FFN, heads, KV heads of the self-attention). 30B: MovieGen's published dims
# (48 x 6144, FFN 16384, 48 heads; 8 KV heads as NeMo's DiTLlama30BConfig); 5B: NeMo's DiTLlama5BConfig.
# Counted with a full adaLN per layer (6 h^2) and MHA cross-attention they are 37.0B and 6.3B
# (tests/test_llama.py). 1B and 3B: ours, sized to their names (NeMo names them, publishes no dims).
_SIZES = {
    "MovieGen-1B": (12, 2048, 5632, 16, 8),
    "MovieGen-3B": (24, 2560, 7168, 20, 4),
    "MovieGen-5B": (32, 3072, 8192, 24, 8),
    "MovieGen-30B": (48, 6144, 16384, 48, 8),
}


def _presets() -> dict:
    table = {name: dict(_VIDEO, num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                        num_attention_heads=heads, num_query_groups=groups)
             for name, (layers, hidden, ffn, heads, groups) in _SIZES.items()}
    table["llama-tiny"] = dict(_LLAMA, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                               num_query_groups=2, patch_size=2, input_size=8, in_channels=4, text_dim=32)
    table["llama-moving-digits"] = dict(_LLAMA, num_layers=4, hidden_size=128, ffn_hidden_size=320,
                                        num_attention_heads=4, num_query_groups=2, patch_size=4, input_size=16,
                                        in_channels=1, text_dim=32)
    return table


PRESETS = _presets()


def preset(name: str, **overrides):
    """A Llama-DiT ``DiTConfig`` from a preset of :data:`PRESETS`."""
    return build_text_preset(PRESETS, name, overrides, family="llama")


FAMILY = ModelFamily(
    name="llama", presets=lambda: PRESETS, make_config=preset, layer_spec=dit_layer_spec, build=build_model,
    token_model_fn=token_model_fn, image_model_fn=image_model_fn, conditioning=("labels", "text"), flops=dit_flops)
