"""The planner's memory prediction against the peaks the project measured on GPUs, without a GPU.

Each measured run in ``benchmarks/results/`` (``benchmarks/throughput.py``'s rows: ``peak_memory_gib`` is
``torch.cuda.max_memory_allocated``) is rebuilt as that script built it (``throughput.run_config``), with the
micro-batch its data made, and predicted by ``dit_mcore.plan.memory.predict_memory(on_gpu=True)``: the trace
eager, and with the run's compiled layers (``model.compile``: what Inductor's partition keeps). The device's
fixed workspace is not counted (the allocator's peak does not see it).

    python benchmarks/plan_gpu_memory.py          # ~1 min on 2 CPU cores
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RESULTS = ROOT / "benchmarks" / "results"
POINTS = ["throughput_H200_dit-xl2_b128_bf16_vs_fp8.jsonl",  # (its first row: bf16)
          "throughput_H200_dit-xl2_b128_one_sync.jsonl",
          "throughput_H200_moviegen3b_packed8k_b1_accumulation4_planned_attention.jsonl"]
PACK_FRAMES = (8, 8, 4, 4, 4, 1, 1, 1, 1)
"""The 8k-token packs' samples in those runs: the mock data's 1/4/8-frame clips of 16 x 16 tokens per frame,
2,048 + 2,048 + 3 x 1,024 + 4 x 256 = 8,192 tokens."""
TEXT_TOKENS = 4  # (the mock data's captions per sample)


def micro_batch(cfg, point: dict):
    """One micro-batch as the run's mock data made it."""
    from energon_data.batch import MicroBatch, cumsum0
    from dit_mcore.parallel.config import ParallelConfig
    mc = cfg.model.build(ParallelConfig())
    side = cfg.model.input_size // mc.patch_size
    extra = {}
    if point["packed_len"]:
        grids = torch.tensor([[t, side, side] for t in PACK_FRAMES])
        seqlens = [math.prod(g) for g in grids.tolist()]
        assert sum(seqlens) == point["packed_len"], seqlens
        if mc.text_dim:
            extra = dict(text_emb=torch.zeros(len(seqlens) * TEXT_TOKENS, mc.text_dim),
                         cu_seqlens_text=cumsum0([TEXT_TOKENS] * len(seqlens)))
        return MicroBatch.packed(torch.zeros(sum(seqlens), mc.patch_dim), cumsum0(seqlens), grids,
                                 torch.zeros(len(seqlens)), **extra)
    rows = point["batch"]
    return MicroBatch.dense(torch.zeros(rows, side * side, mc.patch_dim), (1, side, side),
                            torch.zeros(rows, dtype=torch.long))


def main() -> list[dict]:
    from throughput import run_config
    from dit_mcore.plan.memory import predict_memory
    from dit_mcore.training.memory import GiB
    rows = []
    for name in POINTS:
        point = json.loads((RESULTS / name).read_text().splitlines()[0])
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = run_config(point, run_dir)
        batch = micro_batch(cfg, point)
        predicted = {}
        for compiled in (False, True):
            run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=compiled))
            predicted[compiled] = predict_memory(run, 1, batch, on_gpu=True).total / GiB
        measured = point["peak_memory_gib"]
        rows.append(dict(run=name, measured_gib=round(measured, 2), eager_gib=round(predicted[False], 2),
                         eager_error=round(predicted[False] / measured - 1, 4),
                         compiled_gib=round(predicted[True], 2),
                         compiled_error=round(predicted[True] / measured - 1, 4)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
