"""Conditioning and position embeddings of the adaLN-Zero DiT."""
from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

from dit_mcore.kernels.host_copy import to_device


def timestep_features(t: torch.Tensor, dim: int, freq_shift: float = 0.0,
                      max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features ``[cos | sin]`` of (real-valued) timesteps ``t [N]`` -> ``[N, dim]``.

    ``freq_shift`` is the denominator shift of the frequencies (0: facebookresearch/DiT,
    1: diffusers' ``Timesteps(flip_sin_to_cos=True, downscale_freq_shift=1)``).
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / (half - freq_shift))
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """Sinusoidal features followed by a 2-layer SiLU MLP (DiT's ``TimestepEmbedder``)."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256, freq_shift: float = 0.0):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.freq_shift = freq_shift
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        feats = timestep_features(t, self.frequency_embedding_size, self.freq_shift)
        return self.mlp(feats.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class-label table with an extra null row (index ``num_classes``) for classifier-free
    guidance. Label dropout is the trainer's job (``dit_mcore.diffusion``), not hidden in here."""

    def __init__(self, num_classes: int, hidden_size: int, use_null_class: bool):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + int(use_null_class), hidden_size)
        nn.init.normal_(self.embedding_table.weight, std=0.02)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(labels)


def sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    """``[len(pos), dim]`` fixed embedding ``[sin | cos]`` (the DiT/MAE 1D formula), float64."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    out = pos.double()[:, None] * omega[None]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


@lru_cache(maxsize=64)
def sincos_pos_embed(dim: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """Fixed positions for a ``(t, h, w)`` token grid -> ``[t*h*w, dim]`` (float32).

    Frame 0 gets exactly DiT's 2D sin-cos embedding (first half encodes the column, second the row,
    as in the reference). Later frames add ``sincos_1d(t) - sincos_1d(0)`` so images and first video
    frames share positions, and an image model extends to video without changing its image outputs.
    """
    t, h, w = grid
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    spatial = torch.cat([sincos_1d(dim // 2, cols.reshape(-1)), sincos_1d(dim // 2, rows.reshape(-1))], dim=1)
    if t == 1:
        return spatial.float()
    temporal = sincos_1d(dim, torch.arange(t))
    temporal = temporal - temporal[:1]
    return (temporal[:, None, :] + spatial[None]).reshape(t * h * w, dim).float()


@lru_cache(maxsize=32)
def _axis_tables(dim: int, size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(spatial [size, dim//2], temporal [size, dim])`` 1D tables for coordinates < size;
    the temporal one is relative to frame 0 (see :func:`sincos_pos_embed`)."""
    coords = torch.arange(size)
    temporal = sincos_1d(dim, coords)
    return to_device(sincos_1d(dim // 2, coords), device), to_device(temporal - temporal[:1], device)


def sincos_from_positions(positions: torch.Tensor, dim: int, max_coord: int) -> torch.Tensor:
    """Fixed positions for per-token ``(t, h, w)`` coordinates ``[N, 3]`` (each < ``max_coord``, a host
    int) -> ``[N, dim]`` float32. Row ``i`` equals ``sincos_pos_embed(dim, grid)`` at that token's
    place in its grid, for any mix of grids, by gathering from cached 1D tables: no per-sample loop,
    no host sync."""
    size = 1 << max(6, (max_coord - 1).bit_length())  # power-of-two sizes keep the cache small
    spatial, temporal = _axis_tables(dim, size, str(positions.device))
    t, h, w = positions.unbind(-1)
    return (torch.cat([spatial[w], spatial[h]], dim=-1) + temporal[t]).float()


def rope_axis_pairs(head_dim: int) -> tuple[int, int, int]:
    """Rotation pairs of each head given to the ``(t, h, w)`` axes: height and width get
    ``head_dim // 6`` each, time the rest (Wan's split; e.g. 22/21/21 of 64 pairs at head_dim 128)."""
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"3D RoPE needs an even head dim >= 6 (got {head_dim}): set model.hidden_size / "
                         "model.num_attention_heads (or kv_channels) to an even value of at least 6")
    spatial = head_dim // 6
    return head_dim // 2 - 2 * spatial, spatial, spatial


def rope3d_freqs(positions: torch.Tensor, head_dim: int, theta: float = 10000.0,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotation angles of 3D RoPE for per-token ``(t, h, w)`` coordinates ``[N, 3]`` -> ``[N, 1, 1, head_dim]``
    float32, in megatron's layout (``apply_rotary_pos_emb`` rotates channel ``i`` with ``i + head_dim/2``,
    or neighbours when ``interleaved``), so megatron's and TE's RoPE kernels apply it.

    Each axis ``a`` owns ``p_a`` pairs (:func:`rope_axis_pairs`) rotating at the frequencies
    ``theta ** (-k / p_a)``, ``k < p_a``, times the token's coordinate on that axis: relative offsets in
    time, height and width each move their own channels. Built per token, so a packed stream of
    grids, or one context-parallel rank's piece of it, gets exactly the angles of its tokens."""
    angles = []
    for axis, pairs in enumerate(rope_axis_pairs(head_dim)):
        inv = theta ** (-torch.arange(pairs, dtype=torch.float64, device=positions.device) / pairs)
        angles.append(positions[:, axis, None].double() * inv)
    freqs = torch.cat(angles, dim=-1).float()
    freqs = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat([freqs, freqs], dim=-1)
    return freqs[:, None, None, :]
