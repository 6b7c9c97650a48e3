"""DiT model configuration: a megatron-core ``TransformerConfig`` with the DiT fields, plus presets.

Presets follow the DiT paper (Peebles & Xie, 2023, Table 1): S/B/L/XL at patch sizes 2, 4 and 8,
named ``DiT-XL/2`` etc., and a ``tiny`` preset for tests and CPU demos.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from dit_mcore.errors import ConfigError


_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation, as in the reference DiT's MLP (timm ``Mlp``).

    Traced by ``torch.compile`` it is written with the identity ``(1 + tanh(z)) / 2 = sigmoid(2z)``:
    the same function, but Inductor lowers ``tanh`` to libdevice's accurate tanh (tens of
    instructions per element: our suspect for the GELU kernels of a DiT-XL/2 step running below the
    bandwidth a plain pointwise kernel reaches on an H200) and ``sigmoid`` to a fast exponential and
    a division. Eager keeps torch's one fused kernel. (Under selective recompute of the MLP with
    ``compile``, dynamo stops at megatron's checkpoint, so the recomputation inside backward runs eagerly,
    in the tanh form: the same values to the last bits of fp32.)"""
    if _sigmoid_form():
        return x * torch.sigmoid(_TWO_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x)))
    return F.gelu(x, approximate="tanh")


def _sigmoid_form() -> bool:
    """Whether :func:`gelu_tanh` writes the sigmoid form: when traced (a test may ask for it eagerly,
    to compare eager and compiled runs whose float8 casts would round the two forms' last bits
    differently)."""
    return torch.compiler.is_compiling()


@dataclass
class DiTConfig(TransformerConfig):
    """Architecture of an adaLN-Zero DiT on top of megatron-core's transformer config.

    The megatron fields (``num_layers``, ``hidden_size``, ``num_attention_heads``, parallel sizes …)
    keep their meaning; the fields below describe the latent/pixel interface and conditioning.
    """

    cuda_graph_scope: list = field(default_factory=list)
    """megatron's field, whose own default ("full") it has deprecated with a warning at every build; the
    empty list is the same scope (the whole layer)."""

    input_size: int = 32
    """Spatial size (height = width) of the latent the model is trained on; sets the default
    positional-embedding grid. Other sizes still work (positions are computed per grid)."""

    patch_size: int = 2
    """Side of a square spatial patch; each patch becomes one token."""

    patch_size_t: int = 1
    """Temporal patch size (frames per token) for video latents; 1 for image models."""

    in_channels: int = 4
    """Channels of the input latent (4 for the SD VAE, 1 or 3 for pixel-space demos)."""

    learn_sigma: bool = True
    """Predict a variance channel block as in the DiT paper; the output then has
    ``2 * in_channels`` channels, the first half being the objective's prediction."""

    num_classes: int = 1000
    """Number of class labels; label ``num_classes`` is the null class used for CFG."""

    class_dropout_prob: float = 0.1
    """Probability of replacing a label by the null class during training (classifier-free
    guidance). The embedding table has a null row whenever this is > 0."""

    frequency_embedding_size: int = 256
    """Width of the sinusoidal timestep features fed to the timestep MLP."""

    timestep_freq_shift: float = 0.0
    """Denominator shift of the sinusoid frequencies: 0 matches facebookresearch/DiT, 1 matches
    diffusers' ``Timesteps(downscale_freq_shift=1)`` used by ``DiTTransformer2DModel``."""

    attention_backend_name: str = "auto"
    """Local attention kernel from ``kernels.attention_kernels.BACKENDS``: "auto" (the fastest for the
    device and dtype, logged once), "sdpa" (torch's best fused kernel), "sdpa_flash", "sdpa_efficient",
    "sdpa_cudnn", "flash_cpu", "flash_attn", or "math64" (the float64 reference)."""

    text_dim: int = 0
    """Width of the text embeddings the model cross-attends to (the dataset's text encoder width,
    e.g. 4096 for T5-XXL); 0: no cross-attention (the class-conditional adaLN-Zero DiT)."""

    text_dropout_prob: float = 0.1
    """Probability of replacing a sample's text by the learned null text during training
    (classifier-free guidance on text)."""

    position_embedding: str = "sincos"
    """How tokens know where they are: ``"sincos"`` (fixed 2D/3D sin-cos table added to the patch
    embedding, the DiT paper's) or ``"rope3d"`` (3D rotary embedding of queries and keys in every
    self-attention, each head's channels split over time, height and width; MovieGen/Wan style)."""

    rope_theta: float = 10000.0
    """Base of the rotary frequencies (``position_embedding="rope3d"``)."""

    cross_attention_adaln: bool = True
    """With text cross-attention: its input is adaLN-modulated and its output gated (three more adaLN
    chunks per layer, NeMo's cross-attention DiT); False: it reads an affine RMSNorm of the stream and
    its output is added to the residual ungated (MovieGen's Llama DiT)."""

    adaln_lora_rank: int = 0
    """AdaLN-LoRA (Cosmos, arXiv 2501.03575 §5.1): each adaLN modulation (every layer's and the final
    layer's) is ``Linear(hidden, rank)`` then ``Linear(rank, chunks * hidden)``, and one per-sample
    modulation ``[n, 3 * hidden]`` computed once per forward is added to every sub-block's (shift, scale,
    gate). Cosmos-7B / NeMo's ``DiT7BConfig`` (28 x 4096) use rank 256 (Cosmos: 7.2B parameters; this
    project's preset of that shape, whose text keys and values project from the embedded text, 7.9B, where
    full adaLN linears give 11.8B). Both the per-layer up-projection and the shared modulation start at zero, so every
    layer still starts as the identity. 0: a full adaLN linear per layer (the DiT paper's)."""

    spatial_temporal: bool = False
    """ST-DiT: each layer's self-attention runs within each frame, then across the frames at each
    position (two attentions, each modulated and gated), instead of over the whole sample."""

    st_attention: str = "dsp"
    """ST-DiT under context parallel: ``"dsp"`` (each rank holds whole frames; all-to-all of the hidden
    states around the temporal attention's projections, DSP), ``"dsp_overlap"`` (the same cut into two
    pipelined all-to-alls overlapping the projections; inside compiled layers it runs as ``"dsp"``:
    there the all-to-alls are traced collectives, each waited where it is posted, so chunks would
    only add work), or ``"mesh"`` (two levels,
    ``parallel.hierarchical_context_parallel_sizes=[inner, outer]``: frames over ``outer`` ranks,
    each frame's positions over ``inner`` ranks; spatial attention runs Ulysses over the inner group,
    temporal attention switches within the outer group; the degree may exceed the frame count).
    Under sequence parallel the switches move q|k|v inside the attention."""

    float8_recipe: Optional[str] = None
    """FP8 training of the attention and MLP linears with torchao's dynamic scaling: ``"tensorwise"``
    ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (see ``dit_mcore.models.float8``); None: off. (megatron's own ``fp8`` fields
    belong to Transformer Engine and stay unset.)"""

    chunk_tokens: Optional[int] = None
    """Run each layer's MLP branch and the final layer over this many tokens at a time, recomputing each
    chunk in the backward (``dit_mcore.models.chunking``); None: whole."""

    aten_linears: bool = False
    """Experimental, off until a GPU measurement shows it pays (``docs/performance.md``). megatron's local linears multiply with one aten ``linear`` wherever no tensor-parallel
    communication runs inside the matmul (every linear at TP=1, every row-parallel one), the bias in
    the GEMM's epilogue, and the MLP's ``fc1`` returns its output with the bias folded in: less memory
    traffic around the GEMMs under ``torch.compile`` (see ``dit_mcore.models.aten_linear``). False:
    megatron's autograd function everywhere (the default). No effect on Transformer Engine or FP8 linears."""

    fuse_wgrad_accumulation: bool = False
    """Experimental, off until a GPU measurement shows it pays (``docs/performance.md``; the 3B's
    MFU measured 29.2% with it against 30.1% before it). Under megatron DDP, the aten-path linears (see ``aten_linears``) add their weight gradients
    into the parameters' fp32 ``main_grad`` inside the backward, the GEMM doing the add
    (``kernels.wgrad_accumulation``), instead of DDP's hook adding a bf16 gradient after: megatron's
    ``gradient_accumulation_fusion`` without apex. False (the default): DDP's hook adds them."""

    has_cond_embedder: bool = True
    """Every pipeline stage builds the conditioning embedders (timestep, label) and recomputes the
    conditioning from the batch; megatron's ``finalize_model_grads`` sums the gradients of their
    parameters (tagged ``pipeline_parallel``) over the pipeline ranks only when this is set, which
    keeps the copies identical (NeMo leaves it unset and its replicated embedders drift)."""

    def __post_init__(self):
        _validate_dit_fields(self)
        super().__post_init__()

    @property
    def out_channels(self) -> int:
        return self.in_channels * (2 if self.learn_sigma else 1)

    @property
    def patch_dim(self) -> int:
        """Values per input token: ``in_channels * patch_size_t * patch_size**2``."""
        return self.in_channels * self.patch_size_t * self.patch_size ** 2

    @property
    def out_patch_dim(self) -> int:
        return self.out_channels * self.patch_size_t * self.patch_size ** 2

    @property
    def use_cfg_embedding(self) -> bool:
        return self.class_dropout_prob > 0


POSITION_EMBEDDINGS = ("sincos", "rope3d")
ST_ATTENTION = ("dsp", "dsp_overlap", "mesh")


def _validate_dit_fields(cfg: DiTConfig) -> None:
    """Checks done before megatron's own, so errors name our field (``model.*`` on the command
    line) and a fix that passes every check."""
    def need(cond: bool, msg: str):
        if not cond:
            raise ConfigError(msg)

    need(cfg.num_attention_heads > 0, f"model.num_attention_heads={cfg.num_attention_heads}: must be > 0")
    need(cfg.hidden_size % 4 == 0 and cfg.hidden_size % cfg.num_attention_heads == 0,
         f"model.hidden_size={cfg.hidden_size}, model.num_attention_heads={cfg.num_attention_heads}: the width must "
         f"divide by the heads and by 4 (2D sin-cos positions); "
         f"{_width_fix(cfg.hidden_size, cfg.num_attention_heads, cfg.tensor_model_parallel_size)}")
    need(cfg.patch_size >= 1, f"model.patch_size={cfg.patch_size}: must be >= 1")
    need(cfg.patch_size_t >= 1, f"model.patch_size_t={cfg.patch_size_t}: must be >= 1")
    need(cfg.input_size % cfg.patch_size == 0,
         f"model.patch_size={cfg.patch_size}: must divide model.input_size={cfg.input_size}; "
         f"use a patch size from {[p for p in (1, 2, 4, 8, 16) if cfg.input_size % p == 0]}")
    need(cfg.in_channels >= 1, f"model.in_channels={cfg.in_channels}: must be >= 1")
    need(cfg.num_classes >= 0, f"model.num_classes={cfg.num_classes}: must be >= 0")
    need(0.0 <= cfg.class_dropout_prob < 1.0, f"model.class_dropout_prob={cfg.class_dropout_prob}: must be in [0, 1)")
    need(cfg.text_dim >= 0, f"model.text_dim={cfg.text_dim}: must be >= 0 (0: no text cross-attention)")
    need(0.0 <= cfg.text_dropout_prob < 1.0, f"model.text_dropout_prob={cfg.text_dropout_prob}: must be in [0, 1)")
    groups = cfg.num_query_groups or cfg.num_attention_heads
    need(groups >= 1 and cfg.num_attention_heads % groups == 0,
         f"model.num_query_groups={cfg.num_query_groups}: must divide model.num_attention_heads="
         f"{cfg.num_attention_heads} (key/value heads shared by equal groups of query heads)")
    need(cfg.position_embedding in POSITION_EMBEDDINGS,
         f"model.position_embedding={cfg.position_embedding!r}: use one of {POSITION_EMBEDDINGS}")
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    need(cfg.position_embedding != "rope3d" or (head_dim % 2 == 0 and head_dim >= 6),
         f"model.position_embedding=rope3d needs an even head dim >= 6, got {head_dim} "
         f"(hidden_size {cfg.hidden_size} / {cfg.num_attention_heads} heads); change the width or the heads")
    need(cfg.st_attention in ST_ATTENTION, f"model.st_attention={cfg.st_attention!r}: use one of {ST_ATTENTION}")
    need(0 <= cfg.adaln_lora_rank < cfg.hidden_size,
         f"model.adaln_lora_rank={cfg.adaln_lora_rank}: must be in [0, model.hidden_size={cfg.hidden_size}) "
         "(0: full adaLN linears; Cosmos uses 256)")
    need(cfg.rope_theta > 0, f"model.rope_theta={cfg.rope_theta}: must be > 0")
    need(cfg.frequency_embedding_size % 2 == 0,
         f"frequency_embedding_size={cfg.frequency_embedding_size}: must be even")
    if cfg.float8_recipe is not None:
        _validate_float8(cfg, need)


def _validate_float8(cfg: DiTConfig, need) -> None:
    from dit_mcore.models.float8 import ALIGNMENT, RECIPES, misaligned_dims
    need(cfg.float8_recipe in RECIPES, f"model.fp8={cfg.float8_recipe!r}: use one of {RECIPES} or None (off)")
    need(importlib.util.find_spec("torchao") is not None,
         "model.fp8 needs torchao: pip install 'torchao==0.18.0' (or pip install -e '.[fp8]')")
    bad = misaligned_dims(cfg, head_dim=cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads)
    need(not bad, f"model.fp8={cfg.float8_recipe!r}: float8 GEMMs need every weight dim of the transformer "
                  f"linears divisible by {ALIGNMENT} on the GPU, but {', '.join(bad)}; choose widths that are "
                  f"multiples of {ALIGNMENT} x TP or set model.fp8=None")


def _width_fix(hidden: int, heads: int, tp: int = 1) -> str:
    """Head counts or widths that satisfy the width rules and split over ``tp`` tensor-parallel
    ranks (heads divisible by TP), nearest first."""
    def wider(h: int) -> int:
        step = math.lcm(h, 4)
        return -(-hidden // step) * step

    fits = [h for h in range(tp, hidden + 1, tp) if hidden % h == 0] if hidden % 4 == 0 else []
    options = [f"model.num_attention_heads={min(fits, key=lambda h: (abs(h - heads), h))}"] if fits else []
    if heads % tp == 0:
        options.append(f"model.hidden_size={wider(heads)}")
    else:  # the heads must change anyway: the nearest count TP divides, with a width that fits it
        near = max(tp, round(heads / tp) * tp)
        if wider(near) != hidden:
            options.append(f"model.num_attention_heads={near} with model.hidden_size={wider(near)}")
    return "set " + " or ".join(options)


# Megatron settings every DiT shares: fusions that need apex/TE are off by default (the GPU
# spec turns on TE's fused paths itself), biases as in the reference, tanh-GELU MLP.
# ``use_cpu_initialization``: on a GPU parameters are created on the device (a 30B model cannot be
# initialised on the host); on CPU megatron initialises each whole weight and splits it, so every
# tensor-parallel layout starts from exactly the single-process weights.
_COMMON = dict(
    add_bias_linear=True,
    add_qkv_bias=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
    layernorm_epsilon=1e-6,
    activation_func=gelu_tanh,
    use_cpu_initialization=not torch.cuda.is_available(),
)

# name -> (num_layers, hidden_size, num_attention_heads), DiT paper Table 1.
_SIZES = {
    "S": (12, 384, 6),
    "B": (12, 768, 12),
    "L": (24, 1024, 16),
    "XL": (28, 1152, 16),
}


def _preset_table() -> dict[str, dict]:
    table = {}
    for size, (layers, hidden, heads) in _SIZES.items():
        for patch in (2, 4, 8):
            table[f"DiT-{size}/{patch}"] = dict(num_layers=layers, hidden_size=hidden,
                                                num_attention_heads=heads, patch_size=patch)
    table["tiny"] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, patch_size=2,
                         input_size=8, num_classes=10, in_channels=4)
    # The CPU digits demo: 16x16 grey digits, 4x4 patches -> 16 tokens, small enough to train to
    # class-correct samples on 2 CPU cores in a few minutes.
    table["digits"] = dict(num_layers=4, hidden_size=128, num_attention_heads=4, patch_size=4,
                           input_size=16, in_channels=1, num_classes=10, learn_sigma=False)
    return table


PRESETS = _preset_table()

# The MoE variant (``num_moe_experts`` set): megatron's all-to-all token dispatcher (the one that
# takes variable-length packed batches), top-k aux-loss load balancing, and no linear biases
# (megatron 0.16's expert MLP adds its bias in place into a view and fails in backward).
_MOE_COMMON = dict(
    add_bias_linear=False,
    moe_token_dispatcher_type="alltoall",
    moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=1e-2,
)


def build_preset(table: dict, name: str, overrides: dict, *, family: str = "dit") -> DiTConfig:
    """A ``DiTConfig`` from preset ``name`` of ``table`` plus ``overrides`` (any ``DiTConfig`` /
    ``TransformerConfig`` field), on the settings every DiT shares."""
    if name not in table:
        raise ConfigError(f"unknown preset {name!r} for model.family={family}; valid presets: {', '.join(sorted(table))}")
    fields = {f.name for f in dataclasses.fields(DiTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"unknown DiTConfig field(s) {unknown} in overrides for preset {name!r}")
    kwargs = {**_COMMON, "ffn_hidden_size": None, **table[name], **overrides}
    if kwargs.get("num_moe_experts"):
        kwargs.update({k: v for k, v in _MOE_COMMON.items() if k not in overrides})
    if kwargs["ffn_hidden_size"] is None:
        kwargs["ffn_hidden_size"] = 4 * kwargs["hidden_size"]
    return DiTConfig(**kwargs)


def preset(name: str, **overrides) -> DiTConfig:
    """Build a ``DiTConfig`` from a named preset (``DiT-XL/2``, ``DiT-B/4``, ``tiny`` …).

    ``overrides`` set any ``DiTConfig``/``TransformerConfig`` field.
    """
    if overrides.get("text_dim"):
        raise ConfigError(f"model.text_dim={overrides['text_dim']}: the adaLN-Zero DiT (model.family=dit) has no "
                          "cross-attention; use model.family=dit_xattn for text conditioning")
    return build_preset(PRESETS, name, overrides)
