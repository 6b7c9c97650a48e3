"""Move the sharding of a tensor from one dim to another with one zero-padded all-to-all.

The building block of spatial-temporal attention (:mod:`kernels.spatial_temporal`): a dim of
size ``D`` over ``P`` ranks is cut into blocks of ``c = ceil(D/P)``; rank ``r`` owns
``[r*c, min((r+1)*c, D))``, so only the tail blocks can be short (or empty). The switch pads
the send buffer to equal blocks, so it is a single ``all_to_all_single`` whatever the sizes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_to_all


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def block_size(dim_size: int, parts: int) -> int:
    """Rows per block when ``dim_size`` rows are cut into ``parts`` equal (padded) blocks."""
    return -(-dim_size // parts)


def block_range(dim_size: int, parts: int, index: int) -> tuple[int, int]:
    """Real rows ``[start, end)`` of block ``index`` (may be empty at the tail)."""
    c = block_size(dim_size, parts)
    return min(index * c, dim_size), min((index + 1) * c, dim_size)


def _pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    # cat, not F.pad: its backward slices, so the padding's gradient is simply dropped
    return torch.cat([x, x.new_zeros(shape)], dim)


def _switch_geometry(x, from_dim, to_dim, sizes, group):
    """Validate a switch and return (P, rank, fd, td, A, B, cA, cB, nA, nB)."""
    nd = x.dim()
    fd, td = from_dim % nd, to_dim % nd
    if fd == td:
        raise ValueError(f"switch_shard: from_dim and to_dim must differ, both are {fd}")
    A, B = (int(s) for s in sizes)
    P, r = _size(group), _rank(group)
    cA, cB = block_size(A, P), block_size(B, P)
    a0, a1 = block_range(A, P, r)
    b0, b1 = block_range(B, P, r)
    if x.shape[fd] not in (a1 - a0, cA):
        raise ValueError(f"switch_shard: dim {fd} has {x.shape[fd]} rows, but rank {r}'s block of "
                         f"sizes[0]={A} over {P} ranks has {a1 - a0} ({cA} padded); pass the global size "
                         f"of the sharded dim as sizes[0]")
    if x.shape[td] != B:
        raise ValueError(f"switch_shard: dim {td} has {x.shape[td]} rows but sizes[1]={B}; the dim to "
                         f"shard must be whole (global size) on every rank")
    return P, r, fd, td, A, B, cA, cB, a1 - a0, b1 - b0


def switch_shard(x: torch.Tensor, *, from_dim: int, to_dim: int, sizes: tuple[int, int], group,
                 keep_padding: bool = True) -> torch.Tensor:
    """Move the sharding of ``x`` from ``from_dim`` to ``to_dim`` with one all-to-all.

    On entry ``from_dim`` holds this rank's block of a dim of global size ``sizes[0]`` (real rows,
    or the block padded to ``ceil(sizes[0]/P)``) and ``to_dim`` is whole (``sizes[1]``). On exit
    ``from_dim`` is whole (padding trimmed) and ``to_dim`` holds this rank's block, zero-padded to
    ``ceil(sizes[1]/P)`` rows if ``keep_padding`` else trimmed to its real rows. Differentiable
    (the backward is the inverse all-to-all); identity for a group of one.
    """
    P, r, fd, td, A, B, cA, cB, nA, nB = _switch_geometry(x, from_dim, to_dim, sizes, group)
    if P == 1:
        return x
    xc = torch.movedim(x, (fd, td), (0, 1))
    xc = _pad_dim(_pad_dim(xc, 0, cA), 1, P * cB)
    y = all_to_all(xc, scatter_dim=1, gather_dim=0, group=group)[:A]
    if not keep_padding:
        y = y[:, :nB]
    return torch.movedim(y, (0, 1), (fd, td))
