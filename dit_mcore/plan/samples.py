"""What the planner traces of a run's data: its samples' token grids, dense (a micro-batch of one grid) or
packed (``data.max_seq_len``-token packs filled with the data's sample shapes, each sample attending to
itself), and the text tokens a text model reads per sample."""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig

Grid = tuple[int, int, int]
"""A sample's tokens as (frames, rows, columns) after patching."""


class Samples(NamedTuple):
    """What a run's micro-batches hold: samples of ``grids``, dense (``pack_len`` None: one grid) or packed
    ``pack_len`` tokens to a sequence, drawn with ``weights`` (None: evenly)."""

    grids: list
    pack_len: Optional[int] = None
    weights: Optional[list] = None


def sample_grids(cfg, fix: str) -> list[Grid]:
    """The token grids of the run ``cfg``'s samples: a built-in source's one grid; a mock mix's
    (``data.mock_latent_shapes``); a prepared dataset's latents, from its prepare record (packed: every
    shape it lists; dense: the largest, the one that sets the peak). Packs of a dataset whose record is not
    here (a metadataset, a blend, data prepared elsewhere) are planned as one sample filling the pack (its
    attention an upper bound); ``fix``: what the user can do where dense data gives no shape here."""
    model = cfg.model.build(ParallelConfig())
    pt, p = model.patch_size_t or 1, model.patch_size
    if cfg.data.name == "mock" and cfg.data.mock_latent_shapes and not cfg.data.uses_energon:
        return [(max(1, t // pt), h // p, w // p) for t, h, w in cfg.data.mock_latent_shapes]
    if not cfg.data.uses_energon:
        side = cfg.data.image_size // p
        return [(cfg.data.dense_tokens_per_sample(p, pt) // (side * side), side, side)]
    from energon_data.prepare import prepare_record
    from dit_mcore.training.data_fit import latent_shapes
    record = prepare_record(cfg.data.path) if cfg.data.path and Path(cfg.data.path).is_dir() else None
    shapes = sorted(latent_shapes(record), key=lambda s: s[1:]) if record and record.get("shards") else []
    if not shapes and cfg.data.packs:  # (shapes unknown: one sample filling the pack, its attention an upper bound)
        tokens = cfg.data.max_seq_len
        rows = max(d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0)
        return [(1, rows, tokens // rows)]
    if not shapes:
        raise ConfigError(f"data.path={cfg.data.path!r} has no prepare record listing its latents here (a "
                          f"metadataset, a blend, or data prepared elsewhere): {fix}")
    grids = [(max(1, t // pt), h // p, w // p) for _, t, h, w in shapes]
    return grids if cfg.data.packs else [max(grids, key=math.prod)]


def text_tokens(cfg) -> int:
    """Text tokens per sample the planner assumes for a text model: the built-in captions' encoder's
    length, else 256."""
    if cfg.data.name == "moving_digits" and not cfg.data.uses_energon:
        from energon_data.datasets import moving_digits_text_encoder
        return moving_digits_text_encoder().max_length
    return 256


def pack(grids: list[Grid], pack_len: int, weights: list[float] | None = None) -> list[Grid]:
    """One pack of ``pack_len`` tokens holding the grids in the shares of the data's tokens that samples drawn
    with ``weights`` (default: evenly) give them, as far as the pack allows: each next sample the grid furthest
    below its share that still fits (the larger share first), until none fits. (The step's cost is the
    pack's tokens, padding included, but for attention, which each sample pays for its own length.) A grid
    longer than the pack is refused: the loader skips such samples."""
    sizes = [math.prod(g) for g in grids]
    too_long = [g for g, n in zip(grids, sizes) if n > pack_len]
    if too_long:
        raise ConfigError(f"a sample of {too_long[0][0]}x{too_long[0][1]}x{too_long[0][2]} = "
                          f"{math.prod(too_long[0])} tokens is longer than a pack of {pack_len} (data.max_seq_len): "
                          "the loader would skip every such sample; lengthen the packs or leave that shape out")
    weights = weights or [1.0] * len(grids)
    shares = [w * n / sum(w * n for w, n in zip(weights, sizes)) for w, n in zip(weights, sizes)]
    held, out = [0] * len(grids), []
    while True:
        fitting = [i for i in range(len(grids)) if sum(held) + sizes[i] <= pack_len and shares[i] > 0]
        if not fitting:
            return out
        i = min(fitting, key=lambda j: (held[j] / shares[j], -shares[j]))
        out.append(grids[i])
        held[i] += sizes[i]


def batch_maker(cfg, samples: Samples, text_len: int):
    """``make(micro)``: one data-parallel rank's micro-batch of ``micro`` dense samples of ``samples``' one grid,
    or of ``micro`` packs (:func:`pack`, the tail of each padded), with ``text_len`` text tokens per sample for a
    text model (values do not matter)."""
    from energon_data.batch import MicroBatch, cumsum0
    mc = cfg.model.build(ParallelConfig())
    grids, pack_len, weights = samples
    if pack_len is None and len(grids) != 1:
        raise ValueError("dense micro-batches hold one grid")

    def text(n: int) -> dict:
        return dict(text_emb=torch.zeros(n * text_len, mc.text_dim), cu_seqlens_text=cumsum0([text_len] * n)) \
            if mc.text_dim else {}

    def make(micro: int):
        if pack_len is None:
            grid = grids[0]
            return MicroBatch.dense(torch.zeros(micro, math.prod(grid), mc.patch_dim), grid,
                                    torch.zeros(micro, dtype=torch.long), **text(micro))
        one = pack(grids, pack_len, weights)
        samples = one * micro
        seqlens = [math.prod(g) for g in samples]
        starts = [k * pack_len + sum(seqlens[:len(one)][:i]) for k in range(micro) for i in range(len(one))]
        return MicroBatch.packed(torch.zeros(micro * pack_len, mc.patch_dim), cumsum0(seqlens),
                                 torch.tensor(samples, dtype=torch.int64), torch.zeros(len(samples), dtype=torch.long),
                                 torch.tensor(starts + [micro * pack_len], dtype=torch.int32), **text(len(samples)))
    return make
