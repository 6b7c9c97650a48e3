"""The planner against published multi-GPU DiT runs it was not fitted to: each row's predicted TFLOPS/GPU for
its published layout (``--explain``), and with ``--search`` where that layout ranks in the planner's own search
of the row's cluster (the issue's goal: among the top 5).

    python benchmarks/plan_published_rows.py                       # every row, its published layout (~1 min)
    python benchmarks/plan_published_rows.py --search nemo_7b_8k_tp2 --out rows.jsonl   # a whole search (~20 min)

The rows and their sources (``tests/test_plan_published.py`` holds each within 20%):
- NeMo's DiT performance table (docs.nvidia.com/nemo-framework, "Diffusion Transformers (DiT)", performance:
  32 DGX-H100 nodes; 8k tokens = 256 frames at 256 px, 64k at 1024 px; the table's "74k" is 64k, as its text
  says). Its "7B" is NeMo's ``DiT7BConfig`` (``cosmos_7b_text2world``: 28 x 4096, AdaLN-LoRA 256), whose FLOPs
  per token match the table's TFLOPS over tokens/s; the "28B" taken as 48 x 6144 with the same modulation
  (uncertain: `benchmarks/results/cpu_2026-12-01_plan_published_rows.md`).
- Megatron-Bridge's Wan 2.1 14B (NVIDIA-NeMo/DFM ``examples/models/wan/performance-summary.md``: 128 H100s,
  37,440 tokens, GBS 128, TP2 + SP + CP4, megatron DDP with the distributed optimizer, full recompute):
  325.77 TFLOPS/GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_COSMOS_7B = ["--family", "dit_xattn", "--preset", "DiT-XAttn-7B-Cosmos", "--text-len", "256"]
_28B = [*_COSMOS_7B, "model.num_layers=48", "model.hidden_size=6144", "model.num_attention_heads=48"]
_WAN_14B = ["--family", "dit_xattn", "--preset", "DiT-XAttn-28B", "model.num_layers=40", "model.hidden_size=5120",
            "model.num_attention_heads=40", "model.ffn_hidden_size=13824", "model.text_dim=4096",
            "model.cross_attention_adaln=False", "model.adaln_lora_rank=1", "--text-len", "512"]
_8K, _64K = ["--seq", "8192", "--frames", "32"], ["--seq", "65536", "--frames", "64"]
ROWS = [
    # (name, the planner's command line, the published layout, published TFLOPS/GPU or None: out of memory)
    ("nemo_7b_8k_tp2", [*_COSMOS_7B, *_8K, "--gpus", "256", "--global-batch", "256"], "tp=2,distopt=1", 519.0),
    ("nemo_7b_64k_tp2_cp4", [*_COSMOS_7B, *_64K, "--gpus", "256", "--global-batch", "64"], "tp=2,cp=4,distopt=1",
     439.0),
    ("nemo_7b_8k_unoptimised", [*_COSMOS_7B, *_8K, "--gpus", "256", "--global-batch", "256"], "tp=1", None),
    ("nemo_28b_8k_tp4_pp4", [*_28B, *_8K, "--gpus", "256", "--global-batch", "256"], "tp=4,pp=4,distopt=1", 468.0),
    ("nemo_28b_64k_fsdp_recompute", [*_28B, *_64K, "--gpus", "256", "--global-batch", "256"],
     "fsdp=torch,recompute=full", 445.0),
    ("bridge_wan_14b_37k", [*_WAN_14B, "--seq", "37440", "--frames", "24", "--frame-width", "52", "--gpus", "128",
                            "--global-batch", "128"], "tp=2,cp=4,distopt=1,recompute=full", 325.77),
]
GPU = ["--gpu", "H100-80GB"]


def _same_layout(layout, published) -> bool:
    """The published layout's fields (the micro-batch and chunking, which the rows do not state, free)."""
    return dataclasses.replace(layout, micro_batch=1, chunk_tokens=0) == published


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--search", nargs="*", metavar="ROW", help="rows to search in full (none named: every row)")
    ap.add_argument("--out", help="append one JSON line per row")
    args = ap.parse_args(argv)
    from dit_mcore.plan import cli
    from dit_mcore.plan.search import Layout
    names = [r[0] for r in ROWS] if args.search == [] else args.search
    for name, command, layout, published in ROWS:
        if args.search is not None and name not in names:
            continue
        start = time.time()
        planner = cli.planner_of(cli.parse_args([*command, *GPU]))
        e = cli.explained(planner, layout)
        record = {"row": name, "published_layout": layout, "published_tflops": published,
                  "predicted_tflops": round(e.tflops_per_gpu, 1), "predicted_gib": round(e.memory.total / 2**30, 1),
                  "fits": e.fits, "error": None if published is None else round(e.tflops_per_gpu / published - 1, 3)}
        if args.search is not None:
            done, _ = planner.plan()
            fitting = [x for x in done if x.fits]
            target = Layout.parse(layout)
            rank = next((i + 1 for i, x in enumerate(fitting) if _same_layout(x.layout, target)), None)
            record.update(evaluated=len(done), fitting=len(fitting), published_rank=rank,
                          top5=[f"{x.layout.describe(planner.world)}: {x.tflops_per_gpu:.0f} TFLOPS" for x in fitting[:5]])
        record["seconds"] = round(time.time() - start)
        print(json.dumps(record), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({**record, "command": " ".join(command + GPU)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
