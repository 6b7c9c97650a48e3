"""Energon task encoder: patchify latents, pack images and videos into THD sequences, batch.

Pipeline per data worker: ``encode_sample`` (validate + patchify, may skip) -> packing buffer ->
``select_samples_to_pack`` (best-fit-decreasing into ``max_seq_len``) -> ``pack_selected_samples``
-> ``batch`` (concatenate packs into one THD sequence). See ``energon_data.samples`` for the layout.

Skipped samples are counted per reason by the task encoder instance of the data worker that saw
them; the counts travel to the trainer inside the next batch that worker builds
(``LatentBatch.num_skipped``) and are then reset, so the trainer's running sum (each batch is kept by one
rank) is the total. Counts of a worker's last few samples before the end of an (infinite, so never-ending)
stream are the only ones that can be missed.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from megatron.energon import DefaultTaskEncoder, SkipSample, stateless

from energon_data import shard_safety
from dit_mcore.errors import ConfigError
from energon_data.batch import cumsum0
from energon_data.packing import pack_lengths, round_up, shuffle_bins
from energon_data.samples import EncodedSample, LatentBatch, LatentSample, PackedSample
from energon_data.tokens import grid_positions, patchify

SKIP_REASONS = ("nonfinite", "too_long", "too_large", "bad_shape", "unreadable")


class SkipStreakError(ConfigError):
    """More than ``data.max_consecutive_skips`` samples in a row were skipped: no batch can be built."""


@dataclass
class SkipStreak:
    """The samples one worker skipped since it last accepted one: enough to say why none get through."""

    count: int = 0
    reasons: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    """reason -> ``"key: detail"`` of the first sample of the streak skipped for it."""
    shortest: Optional[int] = None
    longest: Optional[int] = None
    """Padded lengths of the shortest and longest too-long samples of the streak."""

    def add(self, reason: str, key: str, detail: str, padded_len: Optional[int]):
        self.count += 1
        self.reasons[reason] += 1
        self.examples.setdefault(reason, f"{key}: {detail}")
        if padded_len is not None:
            self.shortest = padded_len if self.shortest is None else min(self.shortest, padded_len)
            self.longest = padded_len if self.longest is None else max(self.longest, padded_len)


def patchify_latent(latent: torch.Tensor, patch_size: Sequence[int]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[C, T, H, W]`` -> tokens ``[t*h*w, C*pt*ph*pw]`` and grid (:func:`energon_data.tokens.patchify`)."""
    pt, ph, pw = patch_size
    tokens, grid = patchify(latent.unsqueeze(0), (ph, pw), pt)
    return tokens[0], grid


def layout(samples: Sequence[EncodedSample], total_len: int) -> PackedSample:
    """Lay ``samples`` out back to back, each padded to its ``padded_len``; the last one also takes the
    padding up to ``total_len``."""
    used = sum(s.padded_len for s in samples)
    if used > total_len:
        raise ValueError(f"samples need {used} rows but the pack holds {total_len}")
    dim = samples[0].tokens.shape[1]
    tokens = samples[0].tokens.new_zeros(total_len, dim)
    offsets = [0]
    for s in samples:
        tokens[offsets[-1]:offsets[-1] + len(s.tokens)] = s.tokens
        offsets.append(offsets[-1] + s.padded_len)
    offsets[-1] = total_len
    return PackedSample(
        __key__=",".join(s.__key__ for s in samples),
        __restore_key__=(),  # energon sets it
        __subflavors__=samples[0].__subflavors__,
        tokens=tokens,
        cu_seqlens=cumsum0([len(s.tokens) for s in samples]),
        cu_seqlens_padded=torch.tensor(offsets, dtype=torch.int32),
        text_emb=torch.cat([s.text_emb for s in samples]),
        cu_seqlens_text=cumsum0([len(s.text_emb) for s in samples]),
        grids=torch.tensor([list(s.grid) for s in samples], dtype=torch.int64),
        labels=torch.tensor([s.label for s in samples], dtype=torch.int64),
        keys=[s.__key__ for s in samples],
    )


def concat_packs(packs: Sequence[PackedSample], skipped: Counter, worker_id: int) -> LatentBatch:
    """Concatenate packs along the token dim into one THD sequence with offset ``cu_seqlens``."""
    token_base = [0]
    real_base = [0]
    text_base = [0]
    for p in packs:
        token_base.append(token_base[-1] + len(p.tokens))
        real_base.append(real_base[-1] + int(p.cu_seqlens[-1]))
        text_base.append(text_base[-1] + int(p.cu_seqlens_text[-1]))
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32)]
                           + [p.cu_seqlens[1:] + real_base[i] for i, p in enumerate(packs)])
    cu_padded = torch.cat([torch.zeros(1, dtype=torch.int32)]
                          + [p.cu_seqlens_padded[1:] + token_base[i] for i, p in enumerate(packs)])
    cu_text = torch.cat([torch.zeros(1, dtype=torch.int32)]
                        + [p.cu_seqlens_text[1:] + text_base[i] for i, p in enumerate(packs)])
    grids = torch.cat([p.grids for p in packs])
    total = token_base[-1]
    sample_ids = torch.full((total,), -1, dtype=torch.int64)
    positions = torch.zeros(total, 3, dtype=torch.int64)
    for i in range(len(grids)):
        start, n = int(cu_padded[i]), int(cu_seqlens[i + 1] - cu_seqlens[i])
        sample_ids[start:start + n] = i
        positions[start:start + n] = grid_positions(grids[i].tolist())
    keys = [k for p in packs for k in p.keys]
    return LatentBatch(
        __key__=keys,
        __restore_key__=(),
        __subflavors__=[p.__subflavors__ for p in packs],
        tokens=torch.cat([p.tokens for p in packs]),
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_padded,
        sample_ids=sample_ids,
        positions=positions,
        grids=grids,
        labels=torch.cat([p.labels for p in packs]),
        text_emb=torch.cat([p.text_emb for p in packs]),
        cu_seqlens_text=cu_text,
        samples_per_pack=torch.tensor([len(p.keys) for p in packs], dtype=torch.int64),
        keys=keys,
        num_skipped=sum(skipped.values()),
        skipped_by_reason={r: skipped[r] for r in SKIP_REASONS},
        worker_id=worker_id,
    )


class LatentTaskEncoder(DefaultTaskEncoder[LatentSample, EncodedSample, LatentBatch, LatentBatch]):
    """Patchify + pack + batch for :class:`~energon_data.samples.LatentSample` datasets.

    Args:
        patch_size: ``(pt, ph, pw)`` of the model's patch embedding.
        max_seq_len: rows per pack; samples needing more (after padding) are skipped and counted.
            ``None`` only without packing (no length limit).
        pad_multiple: every sample is padded to a multiple of this many rows (the trainer passes
            ``2 * CP * TP`` so each sample splits evenly across context-parallel ranks).
        packing: whether the loader uses a packing buffer (``batch`` handles both).
        max_abs_value: skip latents with any ``|x|`` above this (corrupt encodes); ``None`` = no limit.
        max_consecutive_skips: raise :class:`SkipStreakError` once more than this many samples in a
            row are skipped; ``None`` = no limit.
    """

    def __init__(self, *, patch_size: Sequence[int] = (1, 2, 2), max_seq_len: Optional[int] = 4096,
                 pad_multiple: int = 1, packing: bool = True, max_abs_value: Optional[float] = None,
                 max_consecutive_skips: Optional[int] = None):
        super().__init__()
        if len(patch_size) != 3 or min(patch_size) < 1:
            raise ValueError(f"patch_size must be (pt, ph, pw) of positive ints, got {patch_size}")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
        if packing and max_seq_len is None:
            raise ValueError("max_seq_len is required when packing is on")
        if max_seq_len is not None and max_seq_len % pad_multiple:
            raise ValueError(f"max_seq_len ({max_seq_len}) must be a multiple of pad_multiple ({pad_multiple}); "
                             f"use {round_up(max_seq_len, pad_multiple)}")
        self.patch_size = tuple(int(p) for p in patch_size)
        self.max_seq_len = max_seq_len
        self.pad_multiple = pad_multiple
        self.packing = packing
        self.max_abs_value = max_abs_value
        self.max_consecutive_skips = max_consecutive_skips
        # Skips since this worker's last batch, and since its last accepted sample; each worker
        # process has its own copy.
        self.skipped: Counter = Counter()
        self.streak = SkipStreak()

    def _skip(self, reason: str, key: str, detail: str, padded_len: Optional[int] = None):
        self.skipped[reason] += 1
        self.streak.add(reason, key, detail, padded_len)
        if self.max_consecutive_skips is not None and self.streak.count > self.max_consecutive_skips:
            raise SkipStreakError(self._streak_message())
        raise SkipSample(f"{key}: {detail}")

    def _streak_message(self) -> str:
        s = self.streak
        counts = ", ".join(f"{reason}: {n}" for reason, n in s.reasons.most_common())
        fixes = "\n".join(f"  - {reason}: {self._skip_fix(reason)}" for reason, _ in s.reasons.most_common())
        return (f"a data loader worker skipped the last {s.count} samples it read ({counts}), so it can never "
                f"build a batch:\n{fixes}\nStopped after more than data.max_consecutive_skips="
                f"{self.max_consecutive_skips} skips in a row (None: no limit).")

    def _skip_fix(self, reason: str) -> str:
        """What is wrong with the samples skipped for ``reason``, and which ``data.*`` field fixes it."""
        example = self.streak.examples[reason]
        if reason == "too_long":
            lo, hi = self.streak.shortest, self.streak.longest
            need, all_fit = (f"{lo}", "") if lo == hi else (f"{lo} to {hi}", f" ({hi} fits them all)")
            return (f"data.max_seq_len={self.max_seq_len} but these samples need {need} tokens after padding "
                    f"(e.g. {example}); raise data.max_seq_len to at least {lo}{all_fit}, or use shorter "
                    "samples or a larger model patch size")
        if reason == "too_large":
            return (f"latent values above data.max_abs_value={self.max_abs_value} (e.g. {example}); raise "
                    "data.max_abs_value (None: no check) if the encoder's scale is right")
        if reason == "nonfinite":
            return f"NaN/Inf values (e.g. {example}); re-encode the dataset (python -m energon_data.prepare)"
        return (f"{example}; the latents must be [C,T,H,W] with T,H,W divisible by the model's patch size "
                f"{self.patch_size}")

    @stateless
    def encode_sample(self, sample: LatentSample) -> EncodedSample:
        latent, key = sample.latent, sample.__key__
        if latent.dim() != 4 or sample.text_emb.dim() != 2:
            self._skip("bad_shape", key, f"latent {tuple(latent.shape)} is not [C,T,H,W] or text "
                       f"{tuple(sample.text_emb.shape)} is not [L,D]")
        if any(n % p for n, p in zip(latent.shape[1:], self.patch_size)):
            self._skip("bad_shape", key, f"latent T,H,W {tuple(latent.shape[1:])} not divisible by "
                       f"patch_size {self.patch_size}")
        seqlen = math.prod(n // p for n, p in zip(latent.shape[1:], self.patch_size))
        padded_len = round_up(seqlen, self.pad_multiple)
        if self.max_seq_len is not None and padded_len > self.max_seq_len:
            self._skip("too_long", key, f"{seqlen} tokens (padded {padded_len}) > max_seq_len {self.max_seq_len}",
                       padded_len)
        if not (torch.isfinite(latent).all() and torch.isfinite(sample.text_emb).all()):
            self._skip("nonfinite", key, "NaN/Inf in latent or text embedding")
        if self.max_abs_value is not None and latent.abs().max() > self.max_abs_value:
            self._skip("too_large", key, f"max |latent| {float(latent.abs().max()):.3g} > {self.max_abs_value}")
        if self.streak.count:
            self.streak = SkipStreak()
        shard_safety.note_success()
        tokens, grid = patchify_latent(latent, self.patch_size)
        label = sample.meta.get("label")
        return EncodedSample.derive_from(sample, tokens=tokens, text_emb=sample.text_emb, grid=grid,
                                         label=-1 if label is None else int(label), padded_len=padded_len)

    def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        # Every sample must land in a bin: energon drops buffer entries left out of all groups.
        bins = pack_lengths([s.padded_len for s in samples], self.max_seq_len)
        bins = shuffle_bins(bins, [s.__key__ for s in samples])
        return [[samples[i] for i in b] for b in bins]

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> PackedSample:
        return layout(samples, self.max_seq_len)

    def batch(self, samples: list[Union[PackedSample, EncodedSample]]) -> LatentBatch:
        if isinstance(samples[0], EncodedSample):
            samples = [layout([s], s.padded_len) for s in samples]
        info = torch.utils.data.get_worker_info()
        skipped, self.skipped = self.skipped, Counter()
        skipped["unreadable"] += sum(shard_safety.failed_samples.values())  # counted by loader.error_handler
        shard_safety.failed_samples.clear()
        return concat_packs(samples, skipped, -1 if info is None else info.id)
