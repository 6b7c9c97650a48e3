"""FLOPs of a DiT training step and MFU, from the config and the batch's real per-sample lengths.

One function counts what a micro-batch costs (:func:`dit_flops`): every matrix product of the
forward pass -- patch embedding, per-sample conditioning (timestep MLP, adaLN linears), per-token
QKV / output projections and MLP (GELU, SwiGLU, or the top-k experts of an MoE layer plus its
router), final projection -- and the attention products ``QK^T`` and ``PV`` *per sample*
(``4 * L_i^2 * heads * head_dim`` each layer), so a packed batch of many short samples costs what
its samples cost, not the square of the pack. Elementwise work (norms, softmax, modulation) is left
out, as in megatron's and torchtitan's counts. Padding tokens are not counted: MFU measures useful
work.

*Model FLOPs* of training are 3x the forward (backward = 2x forward). *Hardware FLOPs* add what
activation recompute runs again: a second forward of the recomputed layers (full recompute), of the
core attention or of the MLP (selective). Checked against ``torch.utils.flop_counter`` in
``tests/test_flops.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# Dense (non-sparse) peak TFLOPS per device and dtype, from the vendors' data sheets (SXM parts).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "fp32": 91.6},
}


@dataclass(frozen=True)
class DiTFlops:
    """Forward FLOPs of one micro-batch, by part (sums over layers and samples)."""

    embed: float
    """Patch embedding, conditioning embedders and adaLN linears, final layer."""
    linear: float
    """QKV and output projections of the attention."""
    mlp: float
    """MLP (or router + top-k experts)."""
    attention: float
    """``QK^T`` and ``PV`` of every sample."""
    layers_recomputed: float = 0.0
    """Fraction of the layers that full recompute runs twice (0 without it)."""
    recompute_attention: bool = False
    recompute_mlp: bool = False

    @property
    def forward(self) -> float:
        return self.embed + self.linear + self.mlp + self.attention

    @property
    def model(self) -> float:
        """Training FLOPs without recompute: forward + backward (2x forward)."""
        return 3.0 * self.forward

    @property
    def hardware(self) -> float:
        """Training FLOPs as executed: :attr:`model` plus the recomputed forward work."""
        if self.layers_recomputed:
            return self.model + self.layers_recomputed * (self.linear + self.mlp + self.attention)
        return self.model + self.attention * self.recompute_attention + self.mlp * self.recompute_mlp


def dit_flops(config, seqlens: Sequence[int], context_lens: Optional[Sequence[int]] = None,
              frames: Optional[Sequence[int]] = None) -> DiTFlops:
    """Forward FLOPs of one micro-batch of samples with ``seqlens`` real tokens each.

    ``frames``: frames (token grid ``t``) per sample, for the ST-DiT (``config.spatial_temporal``),
    whose attention runs within each frame (``T * S^2``) and across frames (``S * T^2``) instead of
    over the whole sample, with a second set of attention projections.

    ``context_lens``: text tokens per sample, for models with cross-attention to text
    (``config.text_dim > 0``): text embedder, K/V projections of the text, Q and output projections,
    and ``QK^T`` / ``PV`` of each sample's tokens against its own text."""
    h, layers = config.hidden_size, config.num_layers
    heads, head_dim = config.num_attention_heads, config.kv_channels or config.hidden_size // config.num_attention_heads
    kv_heads = config.num_query_groups or heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    tokens, samples = float(sum(seqlens)), float(len(seqlens))
    squares = float(sum(n * n for n in seqlens))

    ffn = config.ffn_hidden_size
    fc1_out = 2 * ffn if config.gated_linear_unit else ffn
    mlp_per_token = 2.0 * h * fc1_out + 2.0 * ffn * h
    if config.num_moe_experts:
        ffn = config.moe_ffn_hidden_size or ffn
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        mlp_per_token = config.moe_router_topk * (2.0 * h * fc1_out + 2.0 * ffn * h) + 2.0 * h * config.num_moe_experts

    cond_per_sample = 2.0 * config.frequency_embedding_size * h + 2.0 * h * h  # timestep MLP
    cross = bool(getattr(config, "text_dim", 0))
    if cross and context_lens is None:
        raise ValueError("a cross-attention model's FLOPs need context_lens (text tokens per sample)")
    # adaLN chunks per layer: shift, scale, gate per modulated sub-block
    chunks = 9 if cross and getattr(config, "cross_attention_adaln", True) else 6
    spatial_temporal = getattr(config, "spatial_temporal", False)
    if spatial_temporal:
        if frames is None:
            raise ValueError("an ST-DiT's FLOPs need frames (the token grid's t per sample)")
        chunks += 3
        # spatial: T frames of S = n / T tokens; temporal: S positions of T tokens
        squares = float(sum(n * n / t + n * t for n, t in zip(seqlens, frames)))
    rank = getattr(config, "adaln_lora_rank", 0)

    def modulation(c: int) -> float:  # one adaLN linear of c chunks (AdaLN-LoRA: down- and up-projection)
        return 2.0 * h * rank + 2.0 * rank * c * h if rank else 2.0 * h * c * h
    # every layer's, the final layer's 2 chunks, and AdaLN-LoRA's modulation they share
    adaln_per_sample = layers * modulation(chunks) + modulation(2) + (2.0 * h * 3 * h if rank else 0.0)
    embed = tokens * (2.0 * config.patch_dim * h + 2.0 * h * config.out_patch_dim) \
        + samples * (cond_per_sample + adaln_per_sample)
    linear = layers * tokens * (2.0 * h * (q_dim + 2 * kv_dim) + 2.0 * q_dim * h) * (2 if spatial_temporal else 1)
    attention = layers * 4.0 * squares * q_dim
    if cross:
        text = float(sum(context_lens))
        embed += text * (2.0 * config.text_dim * h + 2.0 * h * h)  # text embedder (2-layer MLP)
        linear += layers * (tokens * 2.0 * (h * q_dim + q_dim * h) + text * 2.0 * h * 2 * q_dim)  # MHA K/V
        attention += layers * 4.0 * float(sum(n * m for n, m in zip(seqlens, context_lens))) * q_dim

    recompute = config.recompute_granularity
    modules = set(config.recompute_modules or ()) if recompute == "selective" else set()
    fraction = 0.0
    if recompute == "full":
        stage_layers = max(1, layers // (config.pipeline_model_parallel_size or 1))
        k = config.recompute_num_layers or 0
        fraction = 1.0 if config.recompute_method == "uniform" else min(k, stage_layers) / stage_layers
    return DiTFlops(
        embed=embed,
        linear=linear,
        mlp=layers * tokens * mlp_per_token,
        attention=attention,
        layers_recomputed=fraction,
        recompute_attention="core_attn" in modules,
        recompute_mlp="mlp" in modules,
    )


def peak_tflops(device: torch.device, dtype: str, override: Optional[float] = None) -> Optional[float]:
    """Dense peak TFLOPS of ``device`` for ``dtype`` (``bf16``, ``fp16``, ``fp8``, ``fp32``): the
    ``override`` if given, else the table entry of a known GPU, else None (MFU is then not reported)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(dtype)
    return None
