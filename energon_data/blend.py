"""Blending several prepared datasets: write an energon MetadatasetV2 yaml.

Energon mixes per SAMPLE, before packing. ``by="tokens"`` asks for token shares instead: dataset
``i`` with token share ``w_i`` and mean tokens per sample ``m_i`` gets sample weight ``w_i / m_i``
(normalised), so that the expected share of tokens it contributes is ``w_i``. ``m_i`` is measured
from the latent shapes stored in the shards (read from each ``latent.pth`` header, not its data;
at most ``max_samples`` samples per dataset, spread over its shards), in tokens after patchify and
padding to ``pad_multiple``. Samples later skipped as too long still count in ``m_i``.

``mode="epoch"`` writes ``blend_epochized``: every epoch of the blend reads dataset ``i`` exactly
``weight`` times over (repetitions), so shares follow dataset sizes times repetitions; token
weighting does not apply there.
"""
from __future__ import annotations

import math
import pickle
import tarfile
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
import yaml


class _ShapeOnlyUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.save``'d tensor's ``data.pkl`` into its shape, never touching the storage."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, *args, **kwargs: tuple(size)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch":
            return name  # storage classes only appear inside persistent ids
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a latent file")

    def persistent_load(self, pid):
        return None


def _tensor_shape(fileobj) -> tuple[int, ...]:
    with zipfile.ZipFile(fileobj) as zf:
        pkl = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        with zf.open(pkl) as f:
            shape = _ShapeOnlyUnpickler(f).load()
    if not isinstance(shape, tuple):
        raise ValueError("latent.pth does not hold a single tensor")
    return shape


def _train_shards(dataset: Path) -> list[Path]:
    split = yaml.safe_load((dataset / ".nv-meta" / "split.yaml").read_text())
    return [dataset / s for s in split["split_parts"]["train"]]


def latent_shapes(dataset: str | Path, max_samples: int = 1024) -> list[tuple[int, ...]]:
    """``[C, T, H, W]`` of up to ``max_samples`` latents of a prepared dataset's train split."""
    shards = _train_shards(Path(dataset))
    per_shard = max(1, math.ceil(max_samples / len(shards)))
    shapes = []
    for shard in shards:
        with tarfile.open(shard) as tar:
            taken = 0
            for member in tar:
                if taken == per_shard:
                    break
                if member.name.endswith(".latent.pth"):
                    shapes.append(_tensor_shape(tar.extractfile(member)))
                    taken += 1
    if not shapes:
        raise ValueError(f"no latent.pth found in {dataset}; is it a prepared latent dataset?")
    return shapes[:max_samples]


def mean_tokens_per_sample(dataset: str | Path, patch_size: Sequence[int], pad_multiple: int = 1,
                           max_samples: int = 1024) -> float:
    """Mean (padded) token count per sample after patchify with ``patch_size = (pt, ph, pw)``."""
    tokens = []
    for shape in latent_shapes(dataset, max_samples):
        n = math.prod(d // p for d, p in zip(shape[1:], patch_size))
        tokens.append(-(-n // pad_multiple) * pad_multiple)
    return sum(tokens) / len(tokens)


def sample_weights(datasets: Sequence[tuple[str, float]], *, by: Literal["samples", "tokens"] = "samples",
                   patch_size: Sequence[int] = (1, 2, 2), pad_multiple: int = 1,
                   max_samples: int = 1024) -> list[float]:
    """Normalised per-sample weights for energon from the requested sample or token shares."""
    for path, w in datasets:
        if not w > 0:
            raise ValueError(f"blend weight for {path} must be > 0, got {w}")
    if by == "samples":
        raw = [w for _, w in datasets]
    elif by == "tokens":
        raw = [w / mean_tokens_per_sample(p, patch_size, pad_multiple, max_samples) for p, w in datasets]
    else:
        raise ValueError(f"blend 'by' must be 'samples' or 'tokens', got {by!r}")
    total = sum(raw)
    return [r / total for r in raw]


def write_blend(path: str | Path, datasets: Sequence[tuple[str, float]], mode: Literal["weight", "epoch"] = "weight",
                *, by: Literal["samples", "tokens"] = "samples", patch_size: Sequence[int] = (1, 2, 2),
                pad_multiple: int = 1, max_samples: int = 1024, split_part: str = "train",
                subflavors: Optional[Sequence[dict]] = None) -> Path:
    """Write a MetadatasetV2 yaml blending ``datasets = [(dataset_dir, weight), ...]``; returns its path.

    ``mode="weight"``: random mixing with the given sample or token shares (``by``), forever.
    ``mode="epoch"``: ``weight`` is the number of repetitions of that dataset per blend epoch.
    Dataset paths are written absolute so the yaml may live anywhere.
    """
    if not datasets:
        raise ValueError("write_blend needs at least one (dataset_path, weight)")
    for p, _ in datasets:
        if not (Path(p) / ".nv-meta").is_dir():
            raise ValueError(f"{p} is not a prepared energon dataset (no .nv-meta); run energon_data.prepare")
    entries = []
    if mode == "weight":
        weights = sample_weights(datasets, by=by, patch_size=patch_size, pad_multiple=pad_multiple,
                                 max_samples=max_samples)
        for (p, _), w in zip(datasets, weights):
            entries.append({"weight": w, "path": str(Path(p).resolve())})
        key = "blend"
    elif mode == "epoch":
        if by != "samples":
            raise ValueError("blend by='tokens' only applies to mode='weight'; epoch blends repeat whole datasets")
        for p, reps in datasets:
            if not reps > 0:
                raise ValueError(f"repetitions for {p} must be > 0, got {reps}")
            entries.append({"repetitions": reps, "path": str(Path(p).resolve())})
        key = "blend_epochized"
    else:
        raise ValueError(f"blend mode must be 'weight' or 'epoch', got {mode!r}")
    if subflavors is not None:
        for entry, sub in zip(entries, subflavors, strict=True):
            entry["subflavors"] = dict(sub)
    doc = {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {split_part: {key: entries}}}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out
