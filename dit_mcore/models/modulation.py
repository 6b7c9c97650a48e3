"""adaLN modulation from per-sample conditioning, memory-lean for packed sequences.

Conditioning is a first-class argument (:class:`Conditioning`), never smuggled through
``attention_mask``. Modulation is computed per *sample* (``[n, hidden]``) and applied to that
sample's tokens. In a dense batch (``[s, b, h]``, one sample per column) that is a broadcast. In a
packed sequence (``[t, 1, h]``) every token must pick its sample's row; gathering ``[t, 6*hidden]``
per layer and letting autograd keep it would cost O(tokens x hidden) per layer, so the gather
happens inside autograd functions that save only the per-sample rows and the token -> sample map,
and scatter-add the per-sample gradients in backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dit_mcore.models.aten_linear import MainGradLinear


@dataclass
class Conditioning:
    """Per-sample conditioning ``emb [n, hidden]`` and, for packed sequences, ``token_to_sample [t]``
    (padding tokens point at any valid sample: their outputs are masked out of the loss)."""

    emb: torch.Tensor
    token_to_sample: Optional[torch.Tensor] = None
    shared: Optional[torch.Tensor] = None
    """AdaLN-LoRA (``model.adaln_lora_rank``): the per-sample modulation ``[n, 3 * hidden]`` every
    sub-block adds to its own (shift, scale, gate); None otherwise."""

    def narrow(self, start: int, length: int) -> "Conditioning":
        """The conditioning of tokens ``start .. start + length`` of the stream (dim 0 of ``[s, b, h]``)."""
        if self.token_to_sample is None:
            return self
        return Conditioning(self.emb, self.token_to_sample.narrow(0, start, length), self.shared)

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x * (1 + scale) + shift`` with per-sample ``shift``/``scale [n, h]``."""
        if self.token_to_sample is None:
            return torch.addcmul(shift.unsqueeze(0), x, 1 + scale.unsqueeze(0))
        return _PackedModulate.apply(x, shift, scale, self.token_to_sample)

    def gated_add(self, residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + gate * x`` with a per-sample ``gate [n, h]``."""
        if self.token_to_sample is None:
            return torch.addcmul(residual, gate.unsqueeze(0), x)
        return _PackedGatedAdd.apply(residual, gate, x, self.token_to_sample)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[t, 1, h]`` (or ``[t, h]``) as ``[t, h]``."""
    return x.reshape(-1, x.shape[-1])


def _scatter_rows(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Sum the rows of ``values [t, h]`` into ``[n, h]`` by ``index [t]`` (at least fp32 accumulation:
    a bf16 sum over thousands of tokens would lose the gradient)."""
    dtype = torch.promote_types(values.dtype, torch.float32)
    out = torch.zeros(n, values.shape[-1], dtype=dtype, device=values.device)
    return out.index_add_(0, index, values.to(dtype))


class _PackedModulate(torch.autograd.Function):
    """``x * (1 + scale[idx]) + shift[idx]``; saves ``x``, ``scale [n, h]`` and ``idx``."""

    @staticmethod
    def forward(ctx, x, shift, scale, idx):
        ctx.save_for_backward(x, scale, idx)
        return torch.addcmul(shift[idx].view_as(x), x, (1 + scale[idx]).view_as(x))

    @staticmethod
    def backward(ctx, dy):
        x, scale, idx = ctx.saved_tensors
        n = scale.shape[0]
        dy_rows = _rows(dy)
        dx = (dy_rows * (1 + scale[idx])).view_as(x) if ctx.needs_input_grad[0] else None
        dshift = _scatter_rows(dy_rows, idx, n).to(scale.dtype) if ctx.needs_input_grad[1] else None
        dscale = _scatter_rows(dy_rows * _rows(x), idx, n).to(scale.dtype) if ctx.needs_input_grad[2] else None
        return dx, dshift, dscale, None


class _PackedGatedAdd(torch.autograd.Function):
    """``residual + gate[idx] * x``; saves ``x``, ``gate [n, h]`` and ``idx``."""

    @staticmethod
    def forward(ctx, residual, gate, x, idx):
        ctx.save_for_backward(gate, x, idx)
        return torch.addcmul(residual, gate[idx].view_as(x), x)

    @staticmethod
    def backward(ctx, dy):
        gate, x, idx = ctx.saved_tensors
        dy_rows = _rows(dy)
        dgate = _scatter_rows(dy_rows * _rows(x), idx, gate.shape[0]).to(gate.dtype) \
            if ctx.needs_input_grad[1] else None
        dx = (dy_rows * gate[idx]).view_as(x) if ctx.needs_input_grad[2] else None
        return dy, dgate, dx, None


class AdaLNModulation(nn.Module):
    """``SiLU -> Linear(hidden, chunks*hidden)`` on the per-sample conditioning, zero-initialised so
    every layer starts as the identity (the "Zero" in adaLN-Zero). Replicated across tensor-parallel
    ranks: its input, the conditioning vector, is the same on all of them. Returns ``chunks``
    per-sample tensors ``[n, hidden]``; :class:`Conditioning` applies them to tokens.

    ``lora_rank`` > 0 (AdaLN-LoRA): ``SiLU -> Linear(hidden, rank, no bias) -> Linear(rank, chunks*hidden)``,
    the second zero-initialised, plus the conditioning's shared modulation repeated over the chunks'
    sub-blocks (a final layer's two chunks take its first two)."""

    def __init__(self, hidden_size: int, chunks: int, lora_rank: int = 0):
        super().__init__()
        self.chunks = chunks
        self.down = MainGradLinear(hidden_size, lora_rank, bias=False) if lora_rank else None
        # Its weight gradient may go into megatron DDP's main_grad inside the GEMM
        # (model.fuse_wgrad_accumulation): a sixth to a third of a DiT's parameters (MovieGen-3B: 28%),
        # whose gradient GEMM has the batch's sample count as K (memory-bound) and otherwise writes a
        # bf16 gradient for DDP's hook to add (12 bytes per parameter against 8).
        self.linear = MainGradLinear(lora_rank or hidden_size, chunks * hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, cond: Conditioning) -> list[torch.Tensor]:
        x = nn.functional.silu(cond.emb)
        if self.down is not None:
            x = self.down(x)
        out = self.linear(x)
        if cond.shared is not None:
            width = out.shape[-1]
            out = out + cond.shared.repeat(1, -(-width // cond.shared.shape[-1]))[:, :width]
        return list(out.chunk(self.chunks, dim=-1))
