"""The one DiT <-> objective adapter: how training, previews, samplers and interop call a
token-level model and read its prediction.

Objectives and samplers speak ``model_fn(x, timestep, labels) -> prediction`` with ``x`` shaped
like the data; the model speaks megatron's ``[s, b, ...]`` token layout and may predict extra
learned-sigma channels. This module is the only place that converts between them.
"""
from __future__ import annotations

from typing import Optional

import torch

from energon_data.batch import MicroBatch
from energon_data.tokens import patchify, unpatchify


def to_model_layout(tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s, D]`` -> megatron's ``[s, b, D]``."""
    return tokens.transpose(0, 1).contiguous()


def prediction(out: torch.Tensor, config) -> torch.Tensor:
    """The objective's prediction ``[b, s, patch_dim]`` from the model output ``[s, b, out_patch_dim]``:
    the first ``patch_dim`` values of each token; the rest are DiT's learned-sigma channels, which
    rectified flow and EDM do not train."""
    return out.transpose(0, 1)[..., : config.patch_dim]


def token_model_fn(model, config, batch: Optional[MicroBatch] = None, grid=None):
    """``fn(x [b, s, D], timestep [n], labels [n], text=None) -> prediction [b, s, patch_dim]`` for the
    layout of ``batch`` (or a dense ``grid``); ``text``: a ``TextContext`` for text families."""

    def fn(x, timestep, labels=None, text=None):
        return prediction(model(to_model_layout(x), timestep, labels, batch=batch, grid=grid, context=text), config)

    return fn


def image_forward(model, config, x: torch.Tensor, timestep: torch.Tensor, labels: Optional[torch.Tensor] = None,
                  *, text=None, keep_sigma: bool = False) -> torch.Tensor:
    """The model on latents ``x [N, C, H, W]`` (or ``[N, C, T, H, W]``) -> the same shape
    (``2C`` channels with ``keep_sigma`` for a learned-sigma model, as the reference DiTs return)."""
    if x.shape[1] != config.in_channels:
        raise ValueError(f"x must have in_channels={config.in_channels} channels, got {tuple(x.shape)}")
    tokens, grid = patchify(x, config.patch_size, config.patch_size_t)
    out = model(to_model_layout(tokens), timestep, labels, grid=grid, context=text)
    channels = config.out_channels if keep_sigma else config.in_channels
    out = out.transpose(0, 1) if keep_sigma else prediction(out, config)
    return unpatchify(out, grid, channels, config.patch_size, config.patch_size_t, squeeze_time=x.dim() == 4)


def image_model_fn(model, config):
    """``model_fn(x [N, C, (T,) H, W], timestep [N], labels, text=None, variance=False) -> prediction`` for
    samplers; ``variance=True``: with a learned-sigma model's variance channels after it (``2C``)."""
    return lambda x, timestep, labels=None, text=None, variance=False: image_forward(
        model, config, x, timestep, labels, text=text, keep_sigma=variance)
