"""Differentiable collectives and the ring exchange used by the context-parallel ops.

Every call goes through ``torch.distributed.<op>`` looked up at call time, so a counter that
wraps those functions sees each transfer. All work on gloo (CPU) and NCCL (GPU).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


# --------------------------------------------------------------------------------------------
# all-to-all


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _functional_exchange(send: torch.Tensor, group) -> torch.Tensor:
    """torch's functional all-to-all: ``torch.compile`` traces it into its graph (the autograd function
    below would break it), and it is differentiable itself. (Not seen by a counter that wraps
    ``torch.distributed``'s functions.)"""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    return all_to_all_single_autograd(send, None, None, group)


def _all_to_all_raw(x, scatter_dim, gather_dim, group, exchange=_exchange):
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[scatter_dim] % world:
        raise ValueError(f"all_to_all: dim {scatter_dim} has size {x.shape[scatter_dim]}, not divisible by "
                         f"the group size {world}; pad it or change the parallel degree")
    # Chunk j of the scatter dim goes to rank j; the received chunks are stacked in rank order
    # along a new leading dim, then folded into the gather dim.
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    return torch.cat(exchange(send, group).unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all_raw(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all_raw(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, *, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split ``x`` into ``P`` chunks along ``scatter_dim``, send chunk ``j`` to group rank ``j``,
    and concatenate what arrives along ``gather_dim`` in rank order. Differentiable: the backward
    is the inverse all-to-all (scatter and gather dims swapped). Identity for a group of one.
    Inside ``torch.compile`` the exchange is torch's functional all-to-all, which the graph holds
    (no break)."""
    nd = x.dim()
    if torch.compiler.is_compiling():
        return _all_to_all_raw(x, scatter_dim % nd, gather_dim % nd, group, _functional_exchange)
    return _AllToAll.apply(x, scatter_dim % nd, gather_dim % nd, group)


# --------------------------------------------------------------------------------------------
# all-gather / reduce-scatter along a dim (raw, used inside hand-written backwards)


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no autograd)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's ``1/P`` slice of ``dim`` (no autograd)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim)


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


def gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order; the backward sums the gradient
    over ranks and keeps this rank's slice (reduce-scatter). Inside ``torch.compile``: torch's
    functional all-gather, which the graph holds (no break)."""
    if torch.compiler.is_compiling() and dist.get_world_size(group) > 1:
        from torch.distributed._functional_collectives import all_gather_tensor_autograd
        return all_gather_tensor_autograd(x.contiguous(), dim % x.dim(), group)
    return _GatherAlong.apply(x, dim, group)


# --------------------------------------------------------------------------------------------
# ring


class RingExchange:
    """Send to the next rank and receive from the previous one in a group's rank order.

    ``tag`` keeps two rings on the same group apart on gloo. ``start(send, recv)`` posts the pair with ``batch_isend_irecv`` and returns at once; ``wait()``
    completes it. Used with two buffers, step ``i+1``'s transfer overlaps step ``i``'s compute.
    """

    def __init__(self, group, tag: int = 0):
        self.group, self.tag = group, tag
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next_peer = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_peer = dist.get_global_rank(group, (rank - 1) % size)
        self._reqs = []

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, send, self.next_peer, group=self.group, tag=self.tag),
               dist.P2POp(dist.irecv, recv, self.prev_peer, group=self.group, tag=self.tag)]
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []
