"""A dimension switch cut into chunks and pipelined with per-chunk compute.

The switch of :func:`kernels.st_switch.switch_shard` moves ``P`` equal blocks per rank.
Cutting every block along the (newly sharded) batch-of-sequences dim gives ``k`` independent
all-to-alls whose results feed independent attention sequences. All ``k`` are posted at once
(``async_op=True``); chunk ``i``'s QKV projection, attention and output projection run while
chunks ``i+1..`` are in flight, and chunk ``i``'s switch back is posted as soon as it is done.
The backward overlaps the same way: the gradient all-to-all of a chunk is posted when its
gradient is ready and awaited only where the input gradient is needed.

Every transfer is a pair of autograd functions, ``_Post`` (posts the all-to-all, output not
yet valid) and ``_Wait`` (waits, then the data may be read); their backwards are the same pair
reversed. All ranks build the same graph, so collectives are posted in the same order on every
rank, in the forward and in the backward. Traced by ``torch.compile`` the transfers break the
graph; the ST-DiT's compiled layers switch in one chunk instead (``model.st_attention``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .st_switch import _pad_dim, _switch_geometry


class _Transfer:
    """State shared by a ``_Post``/``_Wait`` pair: the work handles and the buffers they fill."""

    def __init__(self, group):
        self.group = group
        self.work = self.bufs = None
        self.grad_work = self.grad_bufs = None


def _post(send: torch.Tensor, group):
    recv = torch.empty_like(send)
    # keep both buffers referenced until the transfer is waited on
    return dist.all_to_all_single(recv, send, group=group, async_op=True), (send, recv)


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send, transfer):
        transfer.work, transfer.bufs = _post(send.contiguous(), transfer.group)
        ctx.transfer = transfer
        return transfer.bufs[1]

    @staticmethod
    def backward(ctx, grad):
        t = ctx.transfer
        t.grad_work.wait()
        grad_send = t.grad_bufs[1]
        t.grad_work = t.grad_bufs = None
        return grad_send, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv, transfer):
        transfer.work.wait()
        transfer.work = transfer.bufs = None
        ctx.transfer = transfer
        return recv.view_as(recv)

    @staticmethod
    def backward(ctx, grad):
        t = ctx.transfer
        # [P, ...] blocks: routing block j of rank i to block i of rank j is its own inverse
        t.grad_work, t.grad_bufs = _post(grad.contiguous(), t.group)
        return t.grad_bufs[1], None


def _start(send: torch.Tensor, group) -> tuple[torch.Tensor, _Transfer]:
    transfer = _Transfer(group)
    return _Post.apply(send, transfer), transfer


def _finish(recv: torch.Tensor, transfer: _Transfer) -> torch.Tensor:
    return _Wait.apply(recv, transfer)


def pipelined_switch(g: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor], *, seq_dim: int,
                     bat_dim: int, sizes: tuple[int, int], group, chunks: int) -> torch.Tensor:
    """``switch back(compute(switch(g)))`` with both switches cut into ``chunks`` pieces.

    ``g`` holds a block of ``seq_dim`` (global size ``sizes[0]``) and the whole ``bat_dim``
    (``sizes[1]``); ``compute`` maps a tensor whose ``seq_dim`` is whole and whose ``bat_dim``
    is any subset of sequences to the same shape (the trailing dims may change) and must treat
    the ``bat_dim`` entries independently. Returns the result in ``g``'s layout. ``chunks`` is
    capped at the per-rank block of ``bat_dim``.
    """
    P, _, sd, bd, A, B, cA, cB, nA, _ = _switch_geometry(g, seq_dim, bat_dim, sizes, group)
    if P == 1:
        return compute(g)
    # canonical [P, cA, cB, rest]: block j (dim 0) goes to rank j
    xc = torch.movedim(g, (sd, bd), (0, 1))
    xc = _pad_dim(_pad_dim(xc, 0, cA), 1, P * cB)
    blocks = torch.unflatten(xc, 1, (P, cB)).transpose(0, 1)
    bounds = [(i * cB // min(chunks, cB), (i + 1) * cB // min(chunks, cB)) for i in range(min(chunks, cB))]

    inflight = [_start(blocks[:, :, lo:hi], group) for lo, hi in bounds]
    returning = []
    for recv, transfer in inflight:
        y = _finish(recv, transfer).flatten(0, 1)[:A]                  # [A, chunk, rest]
        o = torch.movedim(compute(torch.movedim(y, (0, 1), (sd, bd))), (sd, bd), (0, 1))
        o = torch.unflatten(_pad_dim(o, 0, P * cA), 0, (P, cA))            # block j returns to rank j
        returning.append(_start(o, group))
    back = torch.cat([_finish(r, t) for r, t in returning], dim=2)      # [P, cA, cB, rest']
    out = back.transpose(0, 1).flatten(1, 2)[:nA, :B]
    return torch.movedim(out, (0, 1), (sd, bd))
