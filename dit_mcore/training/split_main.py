"""fp32 main weights kept as their bf16 model weights plus a 16-bit remainder (``optim.split_main_params``).

A bf16 number is the upper half of an fp32 one. megatron's mixed-precision optimizers keep, beside each
bf16 model weight, an fp32 main weight (4 bytes per parameter, or 4/DP under the distributed optimizer)
whose upper half is, up to rounding, the model weight itself. Here the main weight is that model weight
plus the int16 difference of the two bit patterns: ``fp32 bits = (bf16 bits << 16) + remainder``,
exactly, 2 bytes where megatron keeps 4. The flat AdamW (:mod:`dit_mcore.training.flat_adam`) reads both
halves in its kernel and writes both back, so a main weight never exists as an fp32 tensor during
training: 2 bytes per parameter fewer for the kernel to move (29 instead of 33 by Inductor's count for
an H100, which also counts the fp32 step's bf16 output as read; 19 instead of 23 with bf16 moments and
gradients).

The upper half is the fp32 value rounded to nearest, ties away from zero: rounded to nearest-even, a
tie rounded down would leave a remainder of +2**15, one more than an int16 holds. The model weights
therefore differ from megatron's copy (``.to(bfloat16)``, ties to even) only where the main weight's
lower half is exactly 0x8000, by one bf16 unit there.

Checkpoints keep fp32 main weights, as every other run writes them: around a save or a load
(:func:`whole_main_weights`) the main weights are joined into fp32 tensors (4 bytes per parameter of
the rank's optimizer state, for as long as the save snapshots them or the load copies into them),
then split again, a chunk at a time, and freed. A checkpoint of an fp32 run resumes here (its model weights re-rounded
from the main weights, which moves ties by one unit; under the distributed optimizer each rank
re-rounds its shard, so until the first step's parameter gather another replica may still hold the
loaded value at such a tie) and a checkpoint of this run resumes anywhere.
Outside that window megatron's main weights are stand-ins of their shape that hold no memory (one
element seen at every index): reading them is a bug, and writing them fails.

Since the model weights are the main weights' upper halves, a change to them outside the optimizer
changes the main weights too (megatron's own copy would overwrite it at the next step), its remainders
stale by under one bf16 unit; megatron's ``reload_model_params`` sets them to zero.
"""
from __future__ import annotations

import contextlib

import torch


def split(x: torch.Tensor) -> tuple:
    """fp32 ``x`` as ``(bf16 upper half, int16 remainder)``: the upper half rounded to nearest, ties
    away from zero (bit arithmetic the compiled step generates inline)."""
    bits = x.view(torch.int32)
    upper = (bits + 0x8000) & -65536  # the magnitude rounded at bit 16, the sign kept
    return upper.view(torch.float32).to(torch.bfloat16), (bits - upper).to(torch.int16)


def join(upper: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 values :func:`split` cut into ``upper`` (bf16) and ``remainder`` (int16), exactly."""
    return (upper.float().view(torch.int32) + remainder.int()).view(torch.float32)


CHUNK = 1 << 24
"""Elements split at a time outside the step (:func:`split_into`): its temporaries (12 bytes per
element) stay at 192 MiB, whatever the size of a range."""


def split_into(x: torch.Tensor, upper: torch.Tensor, remainder: torch.Tensor) -> None:
    """:func:`split` of flat fp32 ``x`` written into ``upper`` and ``remainder`` (flat views of its
    length), :data:`CHUNK` elements at a time."""
    for i in range(0, x.numel(), CHUNK):
        hi, lo = split(x[i:i + CHUNK])
        upper[i:i + CHUNK].copy_(hi)
        remainder[i:i + CHUNK].copy_(lo)


def join_into(upper: torch.Tensor, remainder: torch.Tensor, x: torch.Tensor) -> None:
    """:func:`join` of flat ``upper`` and ``remainder`` written into fp32 ``x``, a chunk at a time."""
    for i in range(0, x.numel(), CHUNK):
        x[i:i + CHUNK] = join(upper[i:i + CHUNK], remainder[i:i + CHUNK])


def stand_in(main: torch.Tensor) -> torch.Tensor:
    """What a split main weight's ``.data`` is while no fp32 copy exists: its shape, dtype and device
    (megatron assigns gradients of that shape to it) and one element of memory."""
    return torch.zeros((), dtype=main.dtype, device=main.device).expand(main.shape)


def _split_ranges(optimizer) -> list:
    """The split ranges of the flat AdamW parts (``training.flat_adam.FlatAdamW.ranges``: the parts
    that hold remainders); the module imports nothing of the optimizer that imports it."""
    from dit_mcore.training.torch_optimizer import torch_adams
    return [r for inner in torch_adams(optimizer) for r in getattr(inner, "ranges", ()) if r.rem is not None]


@contextlib.contextmanager
def whole_main_weights(optimizer, *, loading: bool = False):
    """Inside, every split main weight of ``optimizer`` (a megatron optimizer, possibly chained) is an
    fp32 tensor holding its value, so megatron saves it or loads into it as any main weight. On exit
    each is split again and freed; ``loading``: from the values loaded into it, which also become the
    model weights (after the model's own load, so call this around both). A no-op without split main
    weights."""
    ranges = _split_ranges(optimizer)
    try:
        for r in ranges:
            r.whole = torch.zeros_like(r.rem, dtype=torch.float32)
            for m in r.members:  # from the model weights, in the range's buffer or not
                join_into(m.model_view(), r.rem[m.start:m.end], r.whole[m.start:m.end])
                m.main.data = r.whole[m.start:m.end].view(m.main.shape)
        yield
        if loading:  # (a failed load leaves the remainders as they were)
            for r in ranges:
                for m in r.members:
                    split_into(r.whole[m.start:m.end], m.model_view(), r.rem[m.start:m.end])
    finally:
        for r in ranges:
            r.whole = None
            for m in r.members:
                m.main.data = stand_in(m.main)
