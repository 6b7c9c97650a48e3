"""What the planner traces of a run's data: its samples' token grids, dense (a micro-batch of one grid) or
packed (``data.max_seq_len``-token packs as the loader packs the data's samples, each sample attending to
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

PACKING_ROUND = 64
"""Samples the planner packs at once (``data.packing_buffer_size``'s default): the packs of one such round are
what it traces for a packed run, their costs averaged per pack."""


class Samples(NamedTuple):
    """What a run's micro-batches hold: samples of ``grids``, dense (``pack_len`` None: one grid) or packed
    ``pack_len`` tokens to a sequence, drawn with ``weights`` (None: evenly)."""

    grids: list
    pack_len: Optional[int] = None
    weights: Optional[list] = None


def run_samples(cfg, fix: str) -> Samples:
    """The samples of the run ``cfg``'s data: a built-in source's one grid; a mock mix's
    (``data.mock_latent_shapes``, drawn evenly); a prepared dataset's latents from its prepare record (packed:
    every shape it lists that fits a pack, weighted by its shards' samples, split evenly over the shapes a shard
    lists; dense: the largest, the one that sets the peak). Packs of a dataset whose record is not here (a
    metadataset, a blend, data prepared elsewhere) are planned as one sample filling the pack (its attention an
    upper bound); ``fix``: what the user can do where dense data gives no shape here."""
    model = cfg.model.build(ParallelConfig())
    pt, p = model.patch_size_t or 1, model.patch_size
    pack_len = cfg.data.max_seq_len if cfg.data.packs else None
    if cfg.data.name == "mock" and cfg.data.mock_latent_shapes and not cfg.data.uses_energon:
        return Samples([(max(1, t // pt), h // p, w // p) for t, h, w in cfg.data.mock_latent_shapes], pack_len)
    if not cfg.data.uses_energon:
        side = cfg.data.image_size // p
        return Samples([(cfg.data.dense_tokens_per_sample(p, pt) // (side * side), side, side)])
    from energon_data.prepare import prepare_record
    record = prepare_record(cfg.data.path) if cfg.data.path and Path(cfg.data.path).is_dir() else None
    weights: dict = {}
    for shard in (record or {}).get("shards", []):
        shapes = [tuple(s) for s in shard.get("latent_shapes") or [shard["latent_shape"]]]
        for _, t, h, w in shapes:
            grid = (max(1, t // pt), h // p, w // p)
            weights[grid] = weights.get(grid, 0.0) + shard.get("samples", 1) / len(shapes)
    if pack_len is not None:
        weights = {g: n for g, n in weights.items() if math.prod(g) <= pack_len}  # (the loader skips the rest)
        if not weights:  # (shapes unknown: one sample filling the pack, its attention an upper bound)
            rows = max(d for d in range(1, math.isqrt(pack_len) + 1) if pack_len % d == 0)
            return Samples([(1, rows, pack_len // rows)], pack_len)
        grids = sorted(weights)
        return Samples(grids, pack_len, [weights[g] for g in grids])
    if not weights:
        raise ConfigError(f"data.path={cfg.data.path!r} has no prepare record listing its latents here (a "
                          f"metadataset, a blend, or data prepared elsewhere): {fix}")
    return Samples([max(weights, key=math.prod)])


def text_tokens(cfg) -> int:
    """Text tokens per sample the planner assumes for a text model: the built-in captions' encoder's
    length, else 256."""
    if cfg.data.name == "moving_digits" and not cfg.data.uses_energon:
        from energon_data.datasets import moving_digits_text_encoder
        return moving_digits_text_encoder().max_length
    return 256


def packing_round(grids: list[Grid], pack_len: int, weights: Optional[list] = None,
                  samples: int = PACKING_ROUND) -> list[list[Grid]]:
    """The packs the loader makes of ``samples`` samples of ``grids`` drawn with ``weights`` (default: evenly):
    the draws spread evenly (smooth weighted round robin, deterministic), packed best-fit decreasing as the
    energon loader packs its buffer (``energon_data.packing.pack_lengths``). A grid longer than the pack is
    refused: the loader skips such samples."""
    from energon_data.packing import pack_lengths
    sizes = [math.prod(g) for g in grids]
    too_long = [g for g, n in zip(grids, sizes) if n > pack_len]
    if too_long:
        t, h, w = too_long[0]
        raise ConfigError(f"a sample of {t}x{h}x{w} = {t * h * w} tokens is longer than a pack of {pack_len} "
                          "(data.max_seq_len), and the loader would skip every such sample: raise --pack or leave "
                          "that grid out of --mix")
    weights = list(weights or [1.0] * len(grids))
    credit, drawn = [0.0] * len(grids), []
    for _ in range(samples):
        credit = [c + w for c, w in zip(credit, weights)]
        i = max(range(len(grids)), key=lambda j: credit[j])
        credit[i] -= sum(weights)
        drawn.append(i)
    return [[grids[drawn[k]] for k in pack] for pack in pack_lengths([sizes[i] for i in drawn], pack_len)]


def batch_maker(cfg, samples: Samples, text_len: int, round_of: Optional[list] = None):
    """``make(micro)``: one data-parallel rank's micro-batch of ``micro`` dense samples of ``samples``' one grid,
    or of ``micro`` rounds of packs (:func:`packing_round`, or ``round_of``; the tail of each pack padded);
    ``make.packs``: the packs a round holds (1 when dense), whose work the planner averages;
    ``make.heaviest(micro)``: ``micro`` of its pack with the most samples, whose memory the planner counts.
    ``text_len`` text tokens per sample for a text model (values do not matter)."""
    from energon_data.batch import MicroBatch, cumsum0
    mc = cfg.model.build(ParallelConfig())
    grids, pack_len, weights = samples
    if pack_len is None and len(grids) != 1:
        raise ValueError("dense micro-batches hold one grid")
    packs = round_of or (packing_round(grids, pack_len, weights) if pack_len is not None else [])

    def text(n: int) -> dict:
        return dict(text_emb=torch.zeros(n * text_len, mc.text_dim), cu_seqlens_text=cumsum0([text_len] * n)) \
            if mc.text_dim else {}

    def make(micro: int):
        if pack_len is None:
            grid = grids[0]
            return MicroBatch.dense(torch.zeros(micro, math.prod(grid), mc.patch_dim), grid,
                                    torch.zeros(micro, dtype=torch.long), **text(micro))
        laid, starts = [g for _ in range(micro) for pack in packs for g in pack], []
        for k, pack in enumerate(packs * micro):
            starts += [k * pack_len + sum(math.prod(g) for g in pack[:i]) for i in range(len(pack))]
        rows = micro * len(packs) * pack_len
        return MicroBatch.packed(torch.zeros(rows, mc.patch_dim), cumsum0([math.prod(g) for g in laid]),
                                 torch.tensor(laid, dtype=torch.int64), torch.zeros(len(laid), dtype=torch.long),
                                 torch.tensor(starts + [rows], dtype=torch.int32), **text(len(laid)))
    def heaviest(micro: int):
        """``micro`` of the round's pack with the most samples (the most tokens among them): the memory of a
        micro-batch in flight."""
        pack = max(packs, key=lambda p: (len(p), sum(math.prod(g) for g in p)))
        return batch_maker(cfg, Samples(pack, pack_len, None), text_len, round_of=[pack])(micro)
    make.packs, make.heaviest = len(packs) or 1, heaviest
    return make
