"""Bin packing of variable-length samples into fixed-capacity sequences.

Best-fit-decreasing: items are placed longest first, each into the fullest bin that still has room.
It never uses more bins than first-fit-decreasing (both are within 11/9 OPT + 1) and leaves the
slack concentrated in few bins; every item is placed exactly once.
"""
from __future__ import annotations

import bisect
import random
import zlib
from typing import Sequence


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins whose summed lengths are ``<= capacity``.

    Returns bins in order of creation; within a bin, indices are in placement order (decreasing
    length). Ties are broken by index so the result is a deterministic function of the input.
    """
    for i, n in enumerate(lengths):
        if not 0 < n <= capacity:
            raise ValueError(f"item {i} has length {n}, outside (0, capacity={capacity}]; "
                             "skip over-long samples before packing")
    bins: list[list[int]] = []
    # (remaining capacity, bin id) of every open bin, sorted; bisect finds the tightest fit.
    open_bins: list[tuple[int, int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        pos = bisect.bisect_left(open_bins, (n, -1))
        if pos < len(open_bins):
            remaining, b = open_bins.pop(pos)
        else:
            remaining, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if remaining - n > 0:
            bisect.insort(open_bins, (remaining - n, b))
    return bins


def shuffle_bins(bins: list[list[int]], keys: Sequence[str]) -> list[list[int]]:
    """Shuffle the bin order, seeded by the items' keys.

    Best-fit-decreasing emits the long (video) bins first; shuffling decorrelates consecutive packs.
    Seeding from the keys keeps the order a pure function of the buffer content, so a rerun or a
    resumed run packs identically without extra RNG state.
    """
    seed = zlib.crc32("\0".join(keys).encode())
    order = list(range(len(bins)))
    random.Random(seed).shuffle(order)
    return [bins[i] for i in order]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
