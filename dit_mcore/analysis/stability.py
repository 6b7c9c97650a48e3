"""The DiTCacheAnalysis stability claim (arXiv 2411.13588: where a model's step redundancy lies is stable
across prompts, seeds, step counts and samplers, and differs between models) as numbers for one model.

A *curve* is one sampler run's per-evaluation redundancy: the relative L1 change of each layer's residual
contribution from the previous evaluation, averaged over layers (the conditional branch). A *map* is the
same per layer (``[layers, evaluations - 1]``). Correlations are Pearson's, of log10 values (the changes
span orders of magnitude); runs of different lengths are compared on a normalised time axis (evaluation
``e`` of ``E`` at ``e / (E - 1)``), models of different depths on a normalised depth axis too.
"""
from __future__ import annotations

import itertools
from typing import Optional

import numpy as np

GRID = 64
"""Points of the normalised time (and depth) axis runs of different lengths are compared on."""


def pearson(a: np.ndarray, b: np.ndarray) -> Optional[float]:
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if a.size < 2 or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def mean_pairwise(curves: np.ndarray) -> Optional[float]:
    """The mean Pearson correlation over every pair of rows of ``curves [n, ...]`` (log10)."""
    logs = np.log10(curves)
    return _mean(pearson(logs[i], logs[j]) for i, j in itertools.combinations(range(len(logs)), 2))


def between_prompts(curves: np.ndarray) -> Optional[float]:
    """``curves [seeds, items, ...]``: the mean pairwise correlation between items, per seed, averaged."""
    return _mean(mean_pairwise(c) for c in curves)


def between_seeds(curves: np.ndarray) -> Optional[float]:
    """``curves [seeds, items, ...]``: the mean pairwise correlation between seeds, per item, averaged."""
    return _mean(mean_pairwise(curves[:, i]) for i in range(curves.shape[1]))


def variation_across_prompts(rel: np.ndarray) -> Optional[float]:
    """DiTCacheAnalysis' statistic: the coefficient of variation (std / mean) across items of every
    entry of ``rel [seeds, items, ...]``, averaged over seeds and entries."""
    if rel.shape[1] < 2:
        return None
    return float(np.nanmean(rel.std(axis=1) / rel.mean(axis=1)))


def resample(values: np.ndarray, axis: int, start: Optional[float] = None, grid: int = GRID) -> np.ndarray:
    """``values`` linearly interpolated along ``axis`` onto ``grid`` points of ``[start, 1]`` (its ``n``
    points sit at ``(k + 1) / n``: the change into evaluation ``k + 1`` of ``n + 1``; ``start`` defaults to
    the first, ``1 / n``)."""
    values = np.moveaxis(np.asarray(values, dtype=np.float64), axis, -1)
    n = values.shape[-1]
    where = (np.arange(n) + 1) / n
    target = np.linspace(1 / n if start is None else start, 1.0, grid)
    flat = values.reshape(-1, n)
    out = np.stack([np.interp(target, where, row) for row in flat]).reshape(*values.shape[:-1], grid)
    return np.moveaxis(out, -1, axis)


def _common(a: np.ndarray, b: np.ndarray):
    """Both on one normalised time axis (the last), over the part both runs cover."""
    start = max(1 / a.shape[-1], 1 / b.shape[-1])
    return resample(a, -1, start), resample(b, -1, start)


def curve_correlation(a: np.ndarray, b: np.ndarray) -> Optional[float]:
    """Correlation of two mean curves of possibly different lengths, on the normalised time axis."""
    ra, rb = _common(np.log10(a), np.log10(b))
    return pearson(ra, rb)


def map_difference(a: np.ndarray, b: np.ndarray) -> dict:
    """Two maps ``[layers, evaluations - 1]`` (of one model or two): on a common normalised depth and
    time grid, the correlation of their log10 values and the mean absolute difference of log10 (0: the
    same map; 1: a factor of ten apart on average)."""
    la, lb = np.log10(a), np.log10(b)
    if la.shape[0] != lb.shape[0]:  # depth too: layer k of n at (k + 1) / n
        start = max(1 / la.shape[0], 1 / lb.shape[0])
        la, lb = resample(la, 0, start), resample(lb, 0, start)
    ra, rb = _common(la, lb)
    keep = np.isfinite(ra) & np.isfinite(rb)
    return {"correlation": pearson(ra, rb), "mean_abs_log10_difference": float(np.abs(ra - rb)[keep].mean())}


def stability(runs: list[dict]) -> dict:
    """The statistics over an analysis's runs (each ``{"name", "sampler", "steps", "curves" [seeds, items,
    E-1], "maps" [seeds, items, layers, E-1]}``): per run between prompts and seeds; between runs of one
    sampler and different step counts, and of one step count and different samplers."""
    out = {"per_run": {}, "between_step_counts": [], "between_samplers": []}
    for r in runs:
        out["per_run"][r["name"]] = {
            "curves_between_prompts": between_prompts(r["curves"]), "curves_between_seeds": between_seeds(r["curves"]),
            "maps_between_prompts": between_prompts(r["maps"]), "maps_between_seeds": between_seeds(r["maps"]),
            "variation_across_prompts": variation_across_prompts(r["maps"])}
    for a, b in itertools.combinations(runs, 2):
        kind = ("between_step_counts" if a["sampler"] == b["sampler"] else
                "between_samplers" if a["steps"] == b["steps"] else None)
        if kind:
            mean_a, mean_b = a["maps"].mean(axis=(0, 1)), b["maps"].mean(axis=(0, 1))
            out[kind].append({"runs": [a["name"], b["name"]],
                              "curve_correlation": curve_correlation(a["curves"].mean(axis=(0, 1)),
                                                                     b["curves"].mean(axis=(0, 1))),
                              "map": map_difference(mean_a, mean_b)})
    return out
