"""facebookresearch/DiT checkpoints (``DiT-XL-2-256x256.pt`` …) <-> our ``DiT``.

The reference ``DiT`` module: ``x_embedder.proj`` (Conv2d patch embedding), ``t_embedder.mlp``
(sinusoid with frequency shift 0, ``[cos | sin]``), ``y_embedder.embedding_table`` (with the null
class row), a fixed ``pos_embed`` buffer (2D sin-cos, which we compute on the fly), ``blocks.N``
with a timm ``Attention`` (``qkv`` rows ``[3, heads, d]``), a tanh-GELU ``Mlp`` and a 6-chunk
``adaLN_modulation``, and a ``final_layer`` whose rows unpatchify as ``(ph, pw, C)``.
"""
from __future__ import annotations

import math
import warnings
from typing import Mapping

import torch

from dit_mcore.models.dit.config import DiTConfig, preset as build_preset
from dit_mcore.models.dit.interop import layouts
from dit_mcore.models.dit.interop.mapping import InteropError, Rule, build_and_load, export_model
from dit_mcore.models.dit.model import DiT
from dit_mcore.models.embeddings import sincos_pos_embed

_POS_EMBED = "pos_embed"


def _pair(ours: str, theirs: str) -> list[Rule]:
    return [Rule(f"{ours}.weight", (f"{theirs}.weight",)), Rule(f"{ours}.bias", (f"{theirs}.bias",))]


def _qkv_rule(ours: str, theirs: str, heads: int, groups: int) -> Rule:
    # timm packs [all q | all k | all v]; megatron interleaves per query group.
    def to_ours(ts):
        return layouts.qkv_to_ours(*ts[0].chunk(3, dim=0), heads=heads, groups=groups)

    def to_theirs(t):
        return [torch.cat(layouts.qkv_from_ours(t, heads, groups), dim=0)]
    return Rule(ours, (theirs,), to_ours, to_theirs)


def facebookresearch_rules(cfg: DiTConfig) -> list[Rule]:
    """The table for ``cfg``: our parameter names <-> facebookresearch/DiT keys."""
    c, p, heads, groups = cfg.in_channels, cfg.patch_size, cfg.num_attention_heads, cfg.num_query_groups
    rules = [
        Rule("x_embedder.weight", ("x_embedder.proj.weight",), lambda ts: layouts.patch_embed_to_ours(ts[0]),
             lambda t: [layouts.patch_embed_from_ours(t, c, p)]),
        Rule("x_embedder.bias", ("x_embedder.proj.bias",)),
        *_pair("t_embedder.mlp.0", "t_embedder.mlp.0"),
        *_pair("t_embedder.mlp.2", "t_embedder.mlp.2"),
    ]
    if cfg.num_classes > 0:
        rules.append(Rule("y_embedder.embedding_table.weight", ("y_embedder.embedding_table.weight",)))
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"blocks.{i}"
        rules += [
            _qkv_rule(f"{ours}.self_attention.linear_qkv.weight", f"{theirs}.attn.qkv.weight", heads, groups),
            _qkv_rule(f"{ours}.self_attention.linear_qkv.bias", f"{theirs}.attn.qkv.bias", heads, groups),
            *_pair(f"{ours}.self_attention.linear_proj", f"{theirs}.attn.proj"),
            *_pair(f"{ours}.mlp.linear_fc1", f"{theirs}.mlp.fc1"),
            *_pair(f"{ours}.mlp.linear_fc2", f"{theirs}.mlp.fc2"),
            *_pair(f"{ours}.adaLN_modulation.linear", f"{theirs}.adaLN_modulation.1"),
        ]
    c_out = cfg.out_channels
    rules += [
        *_pair("final_layer.adaLN_modulation.linear", "final_layer.adaLN_modulation.1"),
        *[Rule(f"final_layer.linear.{n}", (f"final_layer.linear.{n}",),
               lambda ts: layouts.output_rows_to_ours(ts[0], c_out, p),
               lambda t: [layouts.output_rows_from_ours(t, c_out, p)]) for n in ("weight", "bias")],
    ]
    return rules


def _check_reference_architecture(cfg: DiTConfig) -> None:
    if cfg.patch_size_t != 1:
        raise InteropError(f"facebookresearch/DiT is an image model; patch_size_t must be 1, got {cfg.patch_size_t}")
    if cfg.num_query_groups != cfg.num_attention_heads:
        raise InteropError(f"facebookresearch/DiT uses multi-head attention; num_query_groups "
                           f"({cfg.num_query_groups}) must equal num_attention_heads ({cfg.num_attention_heads})")


def _infer_shape_fields(state_dict: Mapping[str, torch.Tensor], base: DiTConfig) -> dict:
    """``input_size`` from the positional table, ``learn_sigma`` from the final projection."""
    need = [_POS_EMBED, "final_layer.linear.weight"]
    missing = [k for k in need if k not in state_dict]
    if missing:
        raise InteropError(f"facebookresearch state dict lacks {missing}, needed to infer input_size and "
                           "learn_sigma; is this a facebookresearch/DiT `DiT` state dict?")
    tokens = state_dict[_POS_EMBED].shape[-2]
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise InteropError(f"pos_embed has {tokens} positions, not a square grid; expected [1, side*side, hidden]")
    rows = state_dict["final_layer.linear.weight"].shape[0]
    per_channel = base.patch_size ** 2
    channel_options = {base.in_channels * per_channel: False, 2 * base.in_channels * per_channel: True}
    if rows not in channel_options:
        raise InteropError(f"final_layer.linear.weight has {rows} rows; with patch_size={base.patch_size} and "
                           f"in_channels={base.in_channels} expected {sorted(channel_options)} "
                           "(pass the right in_channels/patch_size as overrides or pick the matching preset)")
    return dict(input_size=side * base.patch_size, learn_sigma=channel_options[rows])


def facebookresearch_config(state_dict: Mapping[str, torch.Tensor], preset: str, **overrides) -> DiTConfig:
    """The architecture of a facebookresearch/DiT state dict: ``preset`` with ``overrides``, its
    ``input_size`` and ``learn_sigma`` inferred from the tensors (frequency shift 0, as the reference)."""
    overrides = {"timestep_freq_shift": 0.0, **overrides}
    base = build_preset(preset, **overrides)
    cfg = build_preset(preset, **{**_infer_shape_fields(state_dict, base), **overrides})
    _check_reference_architecture(cfg)
    return cfg


def load_facebookresearch(state_dict: Mapping[str, torch.Tensor], preset: str, **overrides) -> DiT:
    """Build our ``DiT`` from a facebookresearch/DiT state dict.

    ``preset`` (e.g. ``"DiT-XL/2"``) and ``overrides`` give the architecture; ``input_size`` is
    inferred from ``pos_embed`` and ``learn_sigma`` from the final projection unless overridden.
    The timestep sinusoid uses frequency shift 0, as the reference does.
    """
    nested = sorted(k for k, v in state_dict.items() if isinstance(v, Mapping))
    if nested:
        raise InteropError(f"state dict holds nested dicts {nested}: this looks like a training checkpoint; "
                           "pass one of them (usually checkpoint['ema']), not the whole file")
    overrides = {"timestep_freq_shift": 0.0, **overrides}
    cfg = facebookresearch_config(state_dict, preset, **overrides)
    h, side = cfg.hidden_size, cfg.input_size // cfg.patch_size
    pos_shape = torch.empty(1, side * side, h)
    model = build_and_load(cfg, facebookresearch_rules(cfg), state_dict, source="facebookresearch/DiT",
                           hint=f"preset {preset!r} with overrides {overrides}",
                           extra_expected={_POS_EMBED: pos_shape})
    ours = sincos_pos_embed(h, (1, side, side))
    if not torch.allclose(state_dict[_POS_EMBED].reshape(-1, h).float(), ours, atol=1e-4):
        warnings.warn("the checkpoint's pos_embed differs from the fixed 2D sin-cos table this model computes; "
                      "it is ignored, so outputs will differ from the checkpoint's original model", stacklevel=2)
    return model


def export_facebookresearch(model: DiT) -> dict[str, torch.Tensor]:
    """Our ``DiT`` -> a facebookresearch/DiT state dict (``pos_embed`` included)."""
    cfg = model.config
    _check_reference_architecture(cfg)
    if cfg.timestep_freq_shift != 0:
        warnings.warn(f"facebookresearch/DiT computes timestep features with frequency shift 0 but this model "
                      f"uses {cfg.timestep_freq_shift}; the exported model's outputs will differ", stacklevel=2)
    sd = export_model(model, facebookresearch_rules(cfg))
    side = cfg.input_size // cfg.patch_size
    sd[_POS_EMBED] = sincos_pos_embed(cfg.hidden_size, (1, side, side)).unsqueeze(0)
    return {k: v.clone() for k, v in sd.items()}
