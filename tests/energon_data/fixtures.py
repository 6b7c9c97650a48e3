"""Synthetic prepared energon datasets with controllable sample sizes, for the loading-side tests.

Every sample's latent is a deterministic function of its index, so a test can rebuild the exact
latent that a key refers to (``latent_for``) and check tokens against a reference patchify.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import webdataset as wds
from megatron.energon.flavors.webdataset import BaseWebdatasetFactory

DATASET_YAML = """sample_type: {__module__: energon_data.samples, __class__: LatentSample}
field_map: {latent: latent.pth, text_emb: text.pth, meta: json}
"""


@dataclass(frozen=True)
class SampleSpec:
    """Shape of one synthetic sample: latent ``[channels, frames, height, width]`` and ``text_len`` tokens."""

    frames: int
    height: int
    width: int
    text_len: int
    label: int | None = None
    corrupt: str | None = None  # "nan" or "inf": poison the latent


def mixed_specs(num: int, *, seed: int = 0, video_fraction: float = 0.4, sizes=(4, 8, 12, 16),
                frames=(2, 4, 6), text_lens=(3, 9), labelled: bool = True) -> list[SampleSpec]:
    """Images (1 frame) and videos of random size, all divisible by 2 in every dim."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        t = rng.choice(frames) if rng.random() < video_fraction else 1
        out.append(SampleSpec(t, rng.choice(sizes), rng.choice(sizes), rng.randint(*text_lens),
                              label=(i % 10) if labelled else None))
    return out


def latent_for(index: int, spec: SampleSpec, channels: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(channels, spec.frames, spec.height, spec.width, generator=g).to(torch.bfloat16)
    if spec.corrupt == "nan":
        x[0, 0, 0, 0] = float("nan")
    elif spec.corrupt == "inf":
        x[-1, -1, -1, -1] = float("inf")
    return x


def text_for(index: int, spec: SampleSpec, text_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + index)
    return torch.randn(spec.text_len, text_dim, generator=g).to(torch.bfloat16)


def key_for(prefix: str, index: int) -> str:
    return f"{prefix}{index:06d}"


def write_dataset(root: Path, specs: list[SampleSpec], *, prefix: str = "s", channels: int = 4,
                  text_dim: int = 8, samples_per_shard: int = 25) -> Path:
    """Write ``specs`` as webdataset shards under ``root`` and prepare them for energon (train split only)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    shards = []
    for start in range(0, len(specs), samples_per_shard):
        name = f"shard-{start // samples_per_shard:04d}.tar"
        shards.append(name)
        with wds.TarWriter(str(root / name)) as tw:
            for i in range(start, min(start + samples_per_shard, len(specs))):
                spec = specs[i]
                meta = {"kind": "video" if spec.frames > 1 else "image", "height": spec.height,
                        "width": spec.width, "frames": spec.frames, "fps": 8.0 if spec.frames > 1 else 0.0,
                        "caption": f"sample {i}", "source": "synthetic"}
                if spec.label is not None:
                    meta["label"] = spec.label
                tw.write({"__key__": key_for(prefix, i), "latent.pth": latent_for(i, spec, channels),
                          "text.pth": text_for(i, spec, text_dim), "json": json.dumps(meta).encode()})
    BaseWebdatasetFactory.prepare_dataset(root, shards, split_parts_ratio=[("train", 1.0)], workers=1)
    (root / ".nv-meta" / "dataset.yaml").write_text(DATASET_YAML)
    return root
