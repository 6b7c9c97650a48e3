"""Splitting one micro-batch's token stream over the ranks that share it: context parallel (CP)
and, under sequence parallel (SP), tensor parallel (TP) too.

Layout: the stream (dim 0 of megatron's ``[s, b, h]``, or the whole packed THD stream ``[t, 1, h]``)
is padded at its tail to a multiple of the shard count and cut into equal contiguous pieces; the
rank at CP position ``c`` and TP position ``t`` holds piece ``c * TP + t`` (``t = 0`` without SP).
Megatron's SP layers all-gather over TP inside attention and the MLP, which reassembles exactly
the rank's CP piece, and the context-parallel attention kernels take contiguous CP pieces. DiT
attention is non-causal, so contiguous pieces are balanced and samples may straddle ranks; tail
padding lies outside every sample and is never attended to.

Tokens enter a model whole on every rank (the same noise, positions and conditioning whatever the
layout) and are sliced with :meth:`TokenShard.scatter`; the output is reassembled with
:meth:`TokenShard.gather`, whose backward keeps the rank's slice of the gradient (every rank
computes the same loss on the whole output). Parameters that are not TP-sharded then see only
their rank's tokens: their gradients are partial sums, completed by DDP over DP x CP and, under
SP, by megatron's TP all-reduce of parameters flagged ``sequence_parallel``
(:func:`mark_sequence_parallel_params`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state


@dataclass(frozen=True)
class TokenShard:
    """This rank's piece of a token stream split ``size`` ways over ``group``."""

    size: int = 1
    index: int = 0
    group: Optional[dist.ProcessGroup] = None
    tp: int = 1
    """Pieces per context-parallel piece: the TP size under sequence parallel, else 1."""

    @classmethod
    def from_config(cls, config) -> "TokenShard":
        """The sharding megatron's parallel state and ``config`` (CP size, SP flag) imply."""
        cp = config.context_parallel_size
        tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
        if cp * tp == 1:
            return cls()
        tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
        cp_rank = parallel_state.get_context_parallel_rank() if cp > 1 else 0
        if cp > 1 and tp > 1:
            group = parallel_state.get_tensor_and_context_parallel_group()
        elif cp > 1:
            group = parallel_state.get_context_parallel_group()
        else:
            group = parallel_state.get_tensor_model_parallel_group()
        index = cp_rank * tp + tp_rank
        if dist.get_rank(group) != index:
            raise RuntimeError(f"token shard {index} (cp rank {cp_rank}, tp rank {tp_rank}) is rank "
                               f"{dist.get_rank(group)} of its group: megatron's rank order must place TP "
                               "innermost (the default order 'tp-cp-ep-dp-pp')")
        return cls(size=cp * tp, index=index, group=group, tp=tp)

    @property
    def active(self) -> bool:
        return self.size > 1

    def padded(self, total: int) -> int:
        """Stream length after tail padding to a multiple of the shard count."""
        return -(-total // self.size) * self.size

    def local_range(self, total: int) -> tuple[int, int]:
        """``[start, end)`` of this rank's piece of a ``total``-token stream (padded coordinates)."""
        piece = self.padded(total) // self.size
        return self.index * piece, (self.index + 1) * piece

    def attention_range(self, total: int) -> tuple[int, int]:
        """``[start, end)`` of the tokens this rank's attention layers see: its context-parallel
        piece (sequence-parallel layers all-gather the TP pieces of it)."""
        piece = self.padded(total) // self.size * self.tp
        cp_index = self.index // self.tp
        return cp_index * piece, (cp_index + 1) * piece

    def scatter(self, x: torch.Tensor, dim: int = 0, pad_value: float = 0) -> torch.Tensor:
        """This rank's piece of ``x`` along ``dim`` (the whole stream, identical on every rank)."""
        return self._piece(x, dim, pad_value, self.local_range)

    def attention_piece(self, x: torch.Tensor, dim: int = 0, pad_value: float = 0) -> torch.Tensor:
        """The part of ``x`` (the whole stream) that this rank's attention layers see: its
        context-parallel piece (see :meth:`attention_range`), e.g. for per-token rotary angles."""
        return self._piece(x, dim, pad_value, self.attention_range)

    def _piece(self, x: torch.Tensor, dim: int, pad_value: float, cut) -> torch.Tensor:
        if not self.active:
            return x
        total = x.shape[dim]
        extra = self.padded(total) - total
        if extra:
            pad_shape = list(x.shape)
            pad_shape[dim] = extra
            x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim)
        start, end = cut(total)
        return x.narrow(dim, start, end - start)

    def gather(self, x: torch.Tensor, total: int, dim: int = 0) -> torch.Tensor:
        """The whole ``total``-token stream from every rank's piece ``x`` (inverse of :meth:`scatter`).
        Backward keeps this rank's slice of the gradient: every rank must compute the same function
        of the gathered output (the loss), as the trainer does."""
        if not self.active:
            return x
        return _GatherPieces.apply(x, dim, total, self)


class _GatherPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, total, shard: TokenShard):
        ctx.dim, ctx.shard, ctx.total = dim, shard, total
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * shard.size, *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=shard.group)
        return out[:total].movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        start, end = ctx.shard.local_range(ctx.total)
        grad = grad.movedim(ctx.dim, 0)
        if end > ctx.total:  # this piece holds tail padding: no gradient reaches it
            grad = torch.cat([grad, grad.new_zeros((end - ctx.total, *grad.shape[1:]))])
        return grad[start:end].movedim(0, ctx.dim).contiguous(), None, None, None


def mark_sequence_parallel_params(module: torch.nn.Module, exclude: tuple = ()) -> None:
    """Flag every parameter that is not TP-sharded as ``sequence_parallel``: under SP it sees only
    this rank's tokens, so megatron's ``finalize_model_grads`` must all-reduce its gradient over TP
    (without this, SP silently trains different weights on each TP rank). ``exclude``: modules whose
    inputs are whole on every TP rank (the text embedder), whose gradients are complete already."""
    skip = {id(p) for m in exclude if m is not None for p in m.parameters()}
    for param in module.parameters():
        if not getattr(param, "tensor_model_parallel", False) and id(param) not in skip:
            param.sequence_parallel = True
