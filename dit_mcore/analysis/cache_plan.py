"""A static cache plan from a redundancy map (``--derive-plan --budget B``): per layer, the evaluations at
which to recompute it, the others reusing its residual of the last recompute (``--cache static:PLAN.json``).

Each layer follows its own measured change: from a recompute on, its residual's relative L1 changes
(the analysis's map, mean over items and seeds) are accumulated, and the layer is recomputed when the sum
reaches a threshold ``tau`` (TeaCache's rule, decided ahead per layer from this model's measurements instead
of at run time from the first layer). The first and the last evaluation run every layer. ``tau`` is the
smallest that reuses at least ``B`` of the layer evaluations (bisection; the reused fraction grows with it).

``kind="evaluations"`` schedules whole evaluations instead, from the change averaged over layers: every layer
runs or every layer reuses (a TeaCache whose skips are chosen ahead from this model's measurements).
"""
from __future__ import annotations

import numpy as np

from dit_mcore.errors import ConfigError


def schedule(changes: np.ndarray, tau: float) -> list[list[int]]:
    """``changes [layers, E-1]`` (into evaluation ``e`` at column ``e - 1``) -> the layers each of the ``E``
    evaluations computes."""
    layers, n = changes.shape[0], changes.shape[1] + 1
    compute = [[] for _ in range(n)]
    for layer in range(layers):
        acc = 0.0
        compute[0].append(layer)
        for e in range(1, n):
            acc += float(changes[layer, e - 1])
            if e == n - 1 or acc >= tau:
                compute[e].append(layer)
                acc = 0.0
    return compute


def reused(compute: list[list[int]], layers: int) -> float:
    return 1.0 - sum(len(c) for c in compute) / (layers * len(compute))


KINDS = ("layers", "evaluations")


def derive_plan(changes: np.ndarray, budget: float, kind: str = "evaluations") -> dict:
    """The plan reusing at least ``budget`` of the layer evaluations with the smallest ``tau`` (at most
    what reusing every evaluation but the first and last allows); ``kind``: per layer or whole evaluations."""
    if kind not in KINDS:
        raise ConfigError(f"--plan-kind {kind}: use one of {', '.join(KINDS)}")
    layers, n = changes.shape[0], changes.shape[1] + 1
    most = 1.0 - 2.0 / n if n > 1 else 0.0
    if not 0.0 < budget < 1.0:
        raise ConfigError(f"--budget {budget}: give the fraction of layer evaluations to reuse, between 0 and 1")
    if budget > most + 1e-12:
        raise ConfigError(f"--budget {budget}: with {n} evaluations at most {most:.3f} can be reused (the first and "
                          "the last run every layer); lower it or add --steps")
    # 0/0 (a residual that is exactly zero, e.g. an adaLN-Zero layer not trained yet): no change
    changes = np.nan_to_num(np.asarray(changes, dtype=np.float64), nan=0.0, posinf=np.inf)
    if kind == "evaluations":
        changes = np.repeat(changes.mean(axis=0, keepdims=True), layers, axis=0)
    finite = changes[np.isfinite(changes)]
    lo, hi = 0.0, float(finite.sum()) + 1.0  # hi: a sum no finite run reaches, every middle evaluation reused
    for _ in range(100):
        mid = (lo + hi) / 2
        if reused(schedule(changes, mid), layers) >= budget:
            hi = mid
        else:
            lo = mid
    compute = schedule(changes, hi)
    if reused(compute, layers) < budget - 1e-12:
        raise ConfigError(f"--budget {budget}: this model's measured changes allow reusing at most "
                          f"{reused(compute, layers):.3f} of the layer evaluations (some change without bound)")
    return {"evaluations": n, "layers": layers, "compute": compute, "threshold": hi, "kind": kind,
            "reused": reused(compute, layers), "budget": budget}
