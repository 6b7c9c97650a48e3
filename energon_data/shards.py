"""Writing webdataset shards and the energon metadata (``.nv-meta``) that makes them loadable.

Shard names are ``shard-000000.tar`` ...; each is written to a temporary name and renamed,
so a crash never leaves a half-written shard under a real name. Energon's index and split
are built with its Python API (no prompts); ``dataset.yaml`` is written by hand because
energon's CLI can only name sample types exported by ``megatron.energon``.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

import yaml

SHARD_PATTERN = "shard-{:06d}.tar"
PREVIOUS_PREFIX = ".previous-"  # the previous output's shards, while an update takes samples from them
OUTPUT_RE = re.compile(r"^(\.previous-shard-\d{6}\.tar|shard-\d{6}\.tar(\.idx)?|\.shard-\d{6}\.tar\.partial)$")
# (.idx: energon's tar index)
META_DIR = ".nv-meta"
SPLIT_NAMES = ("train", "val", "test")

DATASET_YAML = {
    "sample_type": {"__module__": "energon_data.samples", "__class__": "LatentSample"},
    "field_map": {"latent": "latent.pth", "text_emb": "text.pth", "meta": "json"},
}


def shard_name(index: int) -> str:
    return SHARD_PATTERN.format(index)


def write_shard(out: Path, index: int, samples: Iterable[dict[str, Any]]) -> str:
    """Write one shard atomically; each sample dict has ``__key__`` and ``latent.pth``/``text.pth``/``json``."""
    import webdataset as wds

    name = shard_name(index)
    tmp = out / f".{name}.partial"
    with open(tmp, "wb") as f, wds.TarWriter(f) as writer:
        for sample in samples:
            writer.write(sample)
    os.replace(tmp, out / name)
    return name


def remove_outputs(out: Path, keep_previous: bool = False) -> None:
    """Delete everything this tool writes (shards, partial shards, energon metadata), nothing else;
    with ``keep_previous``, not the previous shards an update set aside (:func:`set_aside`)."""
    for p in out.iterdir():
        if OUTPUT_RE.match(p.name) and not (keep_previous and p.name.startswith(PREVIOUS_PREFIX)):
            p.unlink()
    shutil.rmtree(out / META_DIR, ignore_errors=True)


def set_aside(out: Path, names: list[str]) -> None:
    """Rename the shards ``names`` to their ``.previous-`` names and remove the rest of the output."""
    for name in names:
        os.replace(out / name, out / (PREVIOUS_PREFIX + name))
    remove_outputs(out, keep_previous=True)


def read_sample(tar, members: dict, key: str) -> dict[str, Any]:
    """The sample ``key`` of a shard written by :func:`write_shard` (``tar`` open, ``members`` by name)."""
    import io
    import json

    import torch

    def data(ext):
        return tar.extractfile(members[f"{key}.{ext}"]).read()
    return {"latent.pth": torch.load(io.BytesIO(data("latent.pth")), weights_only=True),
            "text.pth": torch.load(io.BytesIO(data("text.pth")), weights_only=True), "json": json.loads(data("json"))}


def assign_splits(num_shards: int, ratios: tuple[float, float, float], seed: int = 42) -> dict[str, list[int]]:
    """Split whole shards into train/val/test by ``ratios`` (normalised).

    Shard counts use largest-remainder rounding, and every split with a positive ratio gets
    at least one shard when there are enough shards (energon's own float cut-offs can round
    a 0.1 split to zero shards). Shards are shuffled with ``seed`` first so that a split is
    not just the last files of the input.
    """
    import random

    if len(ratios) != 3 or any(r < 0 for r in ratios) or sum(ratios) <= 0:
        raise ValueError(f"--split-ratio must be 3 non-negative numbers train,val,test with a positive sum, got {ratios}")
    total = sum(ratios)
    exact = [num_shards * r / total for r in ratios]
    counts = [int(x) for x in exact]
    for i in sorted(range(3), key=lambda i: exact[i] - counts[i], reverse=True)[: num_shards - sum(counts)]:
        counts[i] += 1
    for i in range(3):  # take a shard from the largest split for an empty positive one
        if ratios[i] > 0 and counts[i] == 0:
            donor = max(range(3), key=lambda j: counts[j])
            if counts[donor] > 1:
                counts[donor] -= 1
                counts[i] += 1
    order = list(range(num_shards))
    random.Random(seed).shuffle(order)
    splits, start = {}, 0
    for name, count in zip(SPLIT_NAMES, counts):
        splits[name] = sorted(order[start : start + count])
        start += count
    return splits


def prepare_energon(out: Path, shard_names: list[str], splits: dict[str, list[int]], workers: int = 2) -> None:
    """Build energon's index (``index.sqlite``, ``.info.json``), ``split.yaml`` and ``dataset.yaml``."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    shutil.rmtree(out / META_DIR, ignore_errors=True)
    # Exact shard lists as anchored regexes; "(?!)" matches nothing, for an empty split.
    patterns = [
        (name, "|".join(f"^{re.escape(shard_names[i])}$" for i in idx) or "(?!)") for name, idx in splits.items()
    ]
    # energon's index workers are forked from this process: a collection in one of them would finalize garbage
    # cycles it inherited (a process group's, anything bound to threads the fork did not copy), and crashed a
    # worker in the test suite with a segmentation fault while energon waited for it forever. Collected here,
    # where their threads live, and the rest frozen for the duration, the workers collect only their own.
    gc.collect()
    gc.freeze()
    try:
        BaseWebdatasetFactory.prepare_dataset(
            out, shard_names, split_parts_patterns=patterns, workers=max(1, min(workers, len(shard_names)))
        )
    finally:
        gc.unfreeze()
    with open(out / META_DIR / "dataset.yaml", "w") as f:
        yaml.safe_dump(DATASET_YAML, f, sort_keys=False)
