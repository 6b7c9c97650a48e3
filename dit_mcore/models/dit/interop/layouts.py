"""Weight-layout conversions between our megatron DiT and the reference implementations.

Each function maps a tensor in the *reference* layout to ours (``*_to_ours``) or back. Weights and
biases share the functions: the permuted axis is always dim 0 (output features).
"""
from __future__ import annotations

import torch


def qkv_to_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Separate q/k/v projections -> megatron's fused ``linear_qkv`` rows.

    Megatron groups the rows per query group: ``[group g: its q heads, k_g, v_g]`` (see
    ``SelfAttention.get_query_key_value_tensors``); for plain multi-head attention (groups ==
    heads) that is ``[q0 k0 v0 | q1 k1 v1 | ...]``.
    """
    rest = q.shape[1:]
    d = q.shape[0] // heads
    parts = (q.reshape(groups, heads // groups * d, *rest), k.reshape(groups, d, *rest),
             v.reshape(groups, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def qkv_from_ours(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`qkv_to_ours`: fused megatron rows -> ``(q, k, v)``."""
    rest = qkv.shape[1:]
    d = qkv.shape[0] // (heads + 2 * groups)
    per_group = qkv.reshape(groups, (heads // groups + 2) * d, *rest)
    q, k, v = per_group.split([heads // groups * d, d, d], dim=1)
    return tuple(x.reshape(-1, *rest).contiguous() for x in (q, k, v))


def patch_embed_to_ours(conv_weight: torch.Tensor) -> torch.Tensor:
    """Conv2d patch embedding ``[hidden, C, p, p]`` -> Linear ``[hidden, C*p*p]``; our tokens are
    ordered ``(C, ph, pw)`` exactly so that this is a reshape."""
    return conv_weight.reshape(conv_weight.shape[0], -1)


def patch_embed_from_ours(weight: torch.Tensor, channels: int, patch: int) -> torch.Tensor:
    return weight.reshape(weight.shape[0], channels, patch, patch).contiguous()


def output_rows_to_ours(x: torch.Tensor, channels: int, patch: int) -> torch.Tensor:
    """Final-projection rows ordered ``(ph, pw, C)`` (the references unpatchify with
    ``nhwpqc->nchpwq``) -> our ``(C, ph, pw)`` token order."""
    rest = x.shape[1:]
    y = x.reshape(patch, patch, channels, *rest).movedim(2, 0)
    return y.reshape(-1, *rest).contiguous()


def output_rows_from_ours(x: torch.Tensor, channels: int, patch: int) -> torch.Tensor:
    rest = x.shape[1:]
    y = x.reshape(channels, patch, patch, *rest).movedim(0, 2)
    return y.reshape(-1, *rest).contiguous()
