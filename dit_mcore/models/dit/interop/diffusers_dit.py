"""diffusers ``DiTTransformer2DModel`` directories <-> our ``DiT``.

Differences from our layout that the table handles: separate ``to_q/to_k/to_v`` (ours: one fused,
per-head interleaved ``linear_qkv``), a Conv2d patch embedding, output rows ordered ``(ph, pw, C)``,
and the conditioning embedder stored once per block (``transformer_blocks.i.norm1.emb``) although
diffusers only uses block 0's copy for the final layer and each block's own copy for that block —
we keep one, so import requires the copies to agree (warns otherwise) and export repeats it.

Two numerics are fixed in diffusers' DiT: the timestep sinusoid uses frequency shift 1 and the
attention / final norms use eps 1e-6, while the MLP pre-norm uses the config's ``norm_eps``.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Mapping

import torch

from dit_mcore.models.dit.config import DiTConfig, gelu_tanh, preset
from dit_mcore.models.dit.interop import layouts
from dit_mcore.models.dit.interop.mapping import InteropError, Rule, build_and_load, export_model
from dit_mcore.models.dit.model import DiT

_CLASS_NAMES = ("DiTTransformer2DModel", "Transformer2DModel")
_FIXED_EPS = 1e-6  # diffusers hard-codes this for the attention pre-norm and the final norm
_FREQ_SHIFT = 1.0  # CombinedTimestepLabelEmbeddings: Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)
_FREQ_DIM = 256


def _pair(ours: str, theirs: str) -> list[Rule]:
    return [Rule(f"{ours}.weight", (f"{theirs}.weight",)), Rule(f"{ours}.bias", (f"{theirs}.bias",))]


def _replicated(ours: str, suffix: str, num_layers: int) -> Rule:
    """One of ours <-> the same tensor in every block's ``norm1.emb``."""
    keys = tuple(f"transformer_blocks.{i}.norm1.emb.{suffix}" for i in range(num_layers))

    def to_ours(ts):
        differ = [keys[i] for i in range(1, len(ts)) if not torch.equal(ts[i], ts[0])]
        if differ:
            warnings.warn(f"diffusers checkpoint has per-block conditioning embedders that differ from block 0's "
                          f"({differ}); using block 0's, which diffusers also uses for the final layer",
                          stacklevel=4)
        return ts[0]
    return Rule(ours, keys, to_ours, lambda t: [t.clone() for _ in keys])


def _qkv_rules(ours: str, theirs: str, heads: int, groups: int) -> list[Rule]:
    names = tuple(f"{theirs}.to_{x}" for x in "qkv")
    return [Rule(f"{ours}.{n}", tuple(f"{t}.{n}" for t in names),
                 lambda ts: layouts.qkv_to_ours(*ts, heads=heads, groups=groups),
                 lambda t: layouts.qkv_from_ours(t, heads, groups)) for n in ("weight", "bias")]


def diffusers_rules(cfg: DiTConfig) -> list[Rule]:
    """The table for ``cfg``: our parameter names <-> ``DiTTransformer2DModel`` keys."""
    c, p, heads, groups, n = cfg.in_channels, cfg.patch_size, cfg.num_attention_heads, cfg.num_query_groups, \
        cfg.num_layers
    c_out = cfg.out_channels
    rules = [
        Rule("x_embedder.weight", ("pos_embed.proj.weight",), lambda ts: layouts.patch_embed_to_ours(ts[0]),
             lambda t: [layouts.patch_embed_from_ours(t, c, p)]),
        Rule("x_embedder.bias", ("pos_embed.proj.bias",)),
        _replicated("t_embedder.mlp.0.weight", "timestep_embedder.linear_1.weight", n),
        _replicated("t_embedder.mlp.0.bias", "timestep_embedder.linear_1.bias", n),
        _replicated("t_embedder.mlp.2.weight", "timestep_embedder.linear_2.weight", n),
        _replicated("t_embedder.mlp.2.bias", "timestep_embedder.linear_2.bias", n),
        _replicated("y_embedder.embedding_table.weight", "class_embedder.embedding_table.weight", n),
    ]
    for i in range(n):
        ours, theirs = f"layers.{i}", f"transformer_blocks.{i}"
        rules += [
            *_qkv_rules(f"{ours}.self_attention.linear_qkv", f"{theirs}.attn1", heads, groups),
            *_pair(f"{ours}.self_attention.linear_proj", f"{theirs}.attn1.to_out.0"),
            *_pair(f"{ours}.mlp.linear_fc1", f"{theirs}.ff.net.0.proj"),
            *_pair(f"{ours}.mlp.linear_fc2", f"{theirs}.ff.net.2"),
            *_pair(f"{ours}.adaLN_modulation.linear", f"{theirs}.norm1.linear"),
        ]
    rules += [
        *_pair("final_layer.adaLN_modulation.linear", "proj_out_1"),
        *[Rule(f"final_layer.linear.{x}", (f"proj_out_2.{x}",),
               lambda ts: layouts.output_rows_to_ours(ts[0], c_out, p),
               lambda t: [layouts.output_rows_from_ours(t, c_out, p)]) for x in ("weight", "bias")],
    ]
    return rules


def _config_from_diffusers(dc: Mapping, path: str) -> DiTConfig:
    def need(cond: bool, msg: str):
        if not cond:
            raise InteropError(f"{path}/config.json: {msg}")

    need(dc.get("_class_name") in _CLASS_NAMES, f"_class_name is {dc.get('_class_name')!r}; expected one of "
         f"{_CLASS_NAMES} (a diffusers DiT transformer directory, e.g. the `transformer` folder of a DiT pipeline)")
    need(dc.get("norm_type", "ada_norm_zero") == "ada_norm_zero", "norm_type must be 'ada_norm_zero'")
    need(dc.get("activation_fn", "gelu-approximate") == "gelu-approximate",
         f"activation_fn {dc.get('activation_fn')!r} is not supported; DiT uses 'gelu-approximate'")
    need(dc.get("attention_bias", True), "attention_bias must be true (DiT attention has biases)")
    need(not dc.get("norm_elementwise_affine", False), "norm_elementwise_affine must be false in adaLN-Zero DiT")
    need(dc.get("cross_attention_dim") is None, "cross_attention_dim must be null (DiT has no cross-attention)")
    need(dc.get("num_embeds_ada_norm", 1000) is not None, "num_embeds_ada_norm (number of classes) must be set")
    in_ch = dc.get("in_channels", 4)
    out_ch = dc.get("out_channels") or in_ch
    need(out_ch in (in_ch, 2 * in_ch), f"out_channels ({out_ch}) must be in_channels ({in_ch}) or twice it "
         "(learned sigma)")
    norm_eps = dc.get("norm_eps", 1e-5)
    if norm_eps != _FIXED_EPS:
        # Public diffusers DiT checkpoints are converted facebookresearch weights, trained with 1e-6.
        warnings.warn(f"{path}: diffusers' MLP pre-norm uses norm_eps={norm_eps} but its attention and final norms "
                      f"use {_FIXED_EPS}; this model uses {_FIXED_EPS} everywhere, as facebookresearch/DiT does, "
                      "so outputs differ slightly from diffusers'", stacklevel=3)
    heads = dc.get("num_attention_heads", 16)
    # preset() supplies the shared megatron settings; every architecture field is overridden here.
    return preset("tiny", num_layers=dc.get("num_layers", 28), num_attention_heads=heads,
                  hidden_size=heads * dc.get("attention_head_dim", 72), ffn_hidden_size=None,
                  patch_size=dc.get("patch_size", 2), input_size=dc.get("sample_size", 32), in_channels=in_ch,
                  learn_sigma=out_ch == 2 * in_ch, num_classes=dc.get("num_embeds_ada_norm", 1000),
                  class_dropout_prob=0.1, frequency_embedding_size=_FREQ_DIM, timestep_freq_shift=_FREQ_SHIFT,
                  layernorm_epsilon=_FIXED_EPS)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """The transformer's weights: single or sharded safetensors, or a PyTorch ``.bin``."""
    from safetensors.torch import load_file
    single = os.path.join(path, "diffusion_pytorch_model.safetensors")
    index = single + ".index.json"
    binary = os.path.join(path, "diffusion_pytorch_model.bin")
    if os.path.exists(single):
        return load_file(single)
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(os.path.join(path, shard)).items()}
    if os.path.exists(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise InteropError(f"no weights in {path}: expected diffusion_pytorch_model.safetensors (or its "
                       ".index.json shards, or diffusion_pytorch_model.bin)")


def diffusers_config(path: str) -> DiTConfig:
    """The architecture of a diffusers ``DiTTransformer2DModel`` directory, from its ``config.json``."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise InteropError(f"{config_file} not found; pass the directory written by save_pretrained "
                           "(for a pipeline, its `transformer` subfolder)")
    with open(config_file) as f:
        return _config_from_diffusers(json.load(f), path)


def load_diffusers(path: str) -> DiT:
    """Build our ``DiT`` from a diffusers ``DiTTransformer2DModel`` directory (local files only)."""
    cfg = diffusers_config(path)
    weights = _read_weights(path)
    weights.pop("pos_embed.pos_embed", None)  # the fixed sin-cos table, if an old save kept it
    return build_and_load(cfg, diffusers_rules(cfg), weights, source=f"diffusers ({path})",
                          hint="architecture from its config.json")


def _diffusers_config(cfg: DiTConfig) -> dict:
    """``DiTTransformer2DModel`` init arguments for ``cfg``; raises where diffusers cannot express it."""
    problems = []
    if cfg.patch_size_t != 1:
        problems.append(f"patch_size_t must be 1 (diffusers' DiT is an image model), got {cfg.patch_size_t}")
    if cfg.num_classes <= 0 or not cfg.use_cfg_embedding:
        problems.append("diffusers' DiT is class-conditional with a null-class row: need num_classes > 0 and "
                        "class_dropout_prob > 0")
    if cfg.num_query_groups != cfg.num_attention_heads:
        problems.append(f"num_query_groups ({cfg.num_query_groups}) must equal num_attention_heads")
    if cfg.ffn_hidden_size != 4 * cfg.hidden_size:
        problems.append(f"ffn_hidden_size must be 4 * hidden_size ({4 * cfg.hidden_size}), got {cfg.ffn_hidden_size}")
    if cfg.frequency_embedding_size != _FREQ_DIM:
        problems.append(f"frequency_embedding_size must be {_FREQ_DIM}, got {cfg.frequency_embedding_size}")
    if cfg.activation_func is not gelu_tanh or not cfg.add_bias_linear or not cfg.add_qkv_bias:
        problems.append("MLP must be tanh-GELU with biases on every linear (the DiT defaults)")
    if problems:
        raise InteropError("model cannot be written as a diffusers DiTTransformer2DModel:\n" + "\n".join(problems))
    differ = []
    if cfg.timestep_freq_shift != _FREQ_SHIFT:
        differ.append(f"timestep_freq_shift is {cfg.timestep_freq_shift} (diffusers: {_FREQ_SHIFT})")
    if cfg.layernorm_epsilon != _FIXED_EPS:
        differ.append(f"layernorm_epsilon is {cfg.layernorm_epsilon} (diffusers' attention/final norms: {_FIXED_EPS})")
    if differ:
        warnings.warn("diffusers' DiT fixes some numerics this model sets differently; the exported model's "
                      "outputs will differ from this model's: " + "; ".join(differ), stacklevel=3)
    return dict(num_attention_heads=cfg.num_attention_heads,
                attention_head_dim=cfg.hidden_size // cfg.num_attention_heads, in_channels=cfg.in_channels,
                out_channels=cfg.out_channels, num_layers=cfg.num_layers, dropout=0.0, attention_bias=True,
                sample_size=cfg.input_size, patch_size=cfg.patch_size, activation_fn="gelu-approximate",
                num_embeds_ada_norm=cfg.num_classes, norm_type="ada_norm_zero", norm_elementwise_affine=False,
                norm_eps=cfg.layernorm_epsilon)


def export_diffusers(model: DiT, path: str) -> None:
    """Write ``model`` as a diffusers ``DiTTransformer2DModel`` directory (config.json + safetensors)."""
    from diffusers import DiTTransformer2DModel
    cfg = model.config
    target = DiTTransformer2DModel(**_diffusers_config(cfg))
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:  # save in the model's precision
        target = target.to(dtype)
    target.load_state_dict(export_model(model, diffusers_rules(cfg)), strict=True)
    target.save_pretrained(path, safe_serialization=True)
