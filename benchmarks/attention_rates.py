"""The planner's attention calibration measured on this device: the project's attention (``kernels``'
``segment_attention``, the backend ``auto`` picks: cuDNN for dense batches on Hopper, flash varlen for packs),
forward + backward, by the number of keys each query attends to and the head dim, in the FLOPs the planner
counts (forward ``4 s^2 d`` per head, backward twice that). ``plan/gpus.py`` prices attention by these lengths;
until this has run on a GPU its long-sequence points are the FlashAttention-3 paper's cuDNN figures.

    python benchmarks/attention_rates.py                                   # a GPU: 256..16k keys, d 64/72/128
    python benchmarks/attention_rates.py --lengths 64,128 --tokens 512     # a CPU smoke run

Each length runs as a dense batch of ``tokens / s`` sequences and as one pack of ``tokens / s`` samples, with
``width / d`` heads (the FlashAttention-3 paper's shapes: 16k tokens, width 2048). Prints one line per point
and ``attention_points`` per head dim and layout, ready for ``plan/gpus.py``; writes the rows as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dit_mcore.kernels import Segments, segment_attention  # noqa: E402
from dit_mcore.kernels.attention_kernels import resolve_backend  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(step, device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def point(keys: int, head_dim: int, layout: str, args, device, dtype) -> dict:
    """One measured rate: ``tokens`` tokens as ``tokens / keys`` sequences of ``keys`` tokens."""
    count, heads = max(1, args.tokens // keys), max(1, args.width // head_dim)
    g = torch.Generator().manual_seed(0)
    lengths = [keys] * count
    if layout == "dense":
        shape, segments = (count, keys, heads, head_dim), None
    else:  # (one shorter sample: a pack of equal samples is one batched run, which auto gives the dense kernel)
        lengths.append(max(1, keys // 2))
        shape = (1, sum(lengths), heads, head_dim)
        segments = Segments.from_cu_seqlens(torch.tensor([0, *lengths]).cumsum(0).to(torch.int32))
    q, k, v, dout = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(4))

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        segment_attention(qq, kk, vv, segments=segments, backend=args.backend)[0].backward(dout)

    seconds = _seconds(step, device, args.warmup, args.repeats)
    flops = 3 * 4.0 * heads * head_dim * sum(n * n for n in lengths)  # (as the planner counts: backward = 2 forwards)
    row = dict(layout=layout, keys=keys, head_dim=head_dim, heads=heads, sequences=len(lengths), dtype=str(dtype)[6:],
               backend=resolve_backend(args.backend, q, segments, k), ms=round(1e3 * seconds, 3),
               tflops=round(flops / seconds / 1e12, 2), device=_device_name(device))
    print(f"{layout:6s} keys {keys:6d} d {head_dim:3d} heads {heads:3d} x {count:4d}  {row['ms']:9.3f} ms  "
          f"{row['tflops']:8.2f} TFLOPS ({row['backend']})", flush=True)
    return row


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,512,1024,2048,4096,8192,16384", help="keys per query")
    ap.add_argument("--head-dims", default="64,72,128")
    ap.add_argument("--layouts", default="dense,packed")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per call (sequences = tokens / length)")
    ap.add_argument("--width", type=int, default=2048, help="heads x head dim")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", help="append the rows here (JSON lines)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [point(int(s), int(d), layout, args, device, dtype) for layout in args.layouts.split(",")
            for d in args.head_dims.split(",") for s in args.lengths.split(",")]
    for layout in args.layouts.split(","):
        for d in args.head_dims.split(","):
            points = tuple((r["keys"], r["tflops"]) for r in rows if r["layout"] == layout and r["head_dim"] == int(d))
            print(f"attention_points ({layout}, head dim {d}): {points}")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "command": " ".join(sys.argv)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
