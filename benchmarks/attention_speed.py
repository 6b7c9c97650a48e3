"""Forward+backward time of ``kernels``' local attention against torch SDPA, dense and packed.

Dense inputs are timed against ``F.scaled_dot_product_attention``; packed inputs (several
samples of mixed lengths in one sequence, plus a pack of same-size images) against SDPA run
sample by sample, which is what packing would cost without a packed kernel. On CUDA the
baseline is the fastest SDPA backend (flash, memory-efficient, cuDNN) for each case. Every
repeat times all candidates back to back (interleaved, so load drifts hit them alike) and the
medians are compared.

    OMP_NUM_THREADS=2 python benchmarks/attention_speed.py

Prints one line per case with the ratio ours / SDPA and writes all rows with the command to
``benchmarks/results/attention_speed_<device>.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dit_mcore.kernels import Segments, segment_attention  # noqa: E402
from dit_mcore.kernels.attention_kernels import resolve_backend  # noqa: E402

DENSE = {"1k": (1, 1024), "2k": (2, 1024), "2k_long": (1, 2048)}
"""(batch, sequence length) per dense case."""
PACKED = {"1k_mixed": [256, 128, 64, 192, 256, 128], "2k_mixed": [512, 256, 128, 384, 256, 128, 384],
          "2k_images": [256] * 8}
"""Sample lengths per packed case (mixed: several runs of lengths; images: one batched run)."""


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sdpa_contexts(device):
    """The SDPA variants to time: the default on CPU, each fused backend on CUDA."""
    if device.type != "cuda":
        return {"sdpa": contextlib.nullcontext}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return {f"sdpa_{name}": (lambda b=backend: sdpa_kernel(b)) for name, backend in
            (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
             ("cudnn", SDPBackend.CUDNN_ATTENTION))}


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _sdpa_per_sample(lengths):
    def attend(q, k, v):
        bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
        return torch.cat([_sdpa(q[:, a:e], k[:, a:e], v[:, a:e]) for a, e in zip(bounds[:-1], bounds[1:])], dim=1)
    return attend


def _ours(segments, backend):
    def attend(q, k, v):
        return segment_attention(q, k, v, segments=segments, backend=backend)[0]
    return attend


def _fwd_bwd(attend, context, tensors, dout):
    def step():
        q, k, v = (t.detach().requires_grad_() for t in tensors)
        with context():
            attend(q, k, v).backward(dout)
    return step


def _time_interleaved(steps: dict, device, warmup: int, repeats: int) -> dict:
    """Median seconds per step; a step that fails in warmup (unsupported backend) is dropped."""
    runnable = {}
    for name, step in steps.items():
        try:
            for _ in range(warmup):
                step()
            runnable[name] = step
        except RuntimeError as err:
            print(f"  skip {name}: {str(err).splitlines()[0][:100]}", file=sys.stderr)
    times = {name: [] for name in runnable}
    for _ in range(repeats):
        for name, step in runnable.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _case(name, kind, lengths, batch, ours, baseline, args, device, dtype):
    g = torch.Generator().manual_seed(0)
    seq = sum(lengths) if kind == "packed" else lengths[0]
    tensors = [torch.randn(batch, seq, args.heads, args.head_dim, generator=g).to(device, dtype) for _ in range(3)]
    dout = torch.randn(batch, seq, args.heads, args.head_dim, generator=g).to(device, dtype)
    steps = {"ours": _fwd_bwd(ours, contextlib.nullcontext, tensors, dout)}
    steps.update({label: _fwd_bwd(baseline, ctx, tensors, dout) for label, ctx in _sdpa_contexts(device).items()})
    medians = _time_interleaved(steps, device, args.warmup, args.repeats)
    sdpa_name = min((n for n in medians if n != "ours"), key=medians.get)
    row = dict(case=name, kind=kind, batch=batch, lengths=lengths, tokens=batch * seq, heads=args.heads,
               head_dim=args.head_dim, dtype=str(dtype).replace("torch.", ""), device=_device_name(device),
               threads=torch.get_num_threads(), backend=resolve_backend(args.backend, tensors[0]),
               ours_ms=round(1e3 * medians["ours"], 3), sdpa_ms=round(1e3 * medians[sdpa_name], 3),
               sdpa_backend=sdpa_name, ratio=round(medians["ours"] / medians[sdpa_name], 3))
    print(f"{kind:6s} {name:10s} tokens={row['tokens']:5d} ours {row['ours_ms']:9.2f} ms  {sdpa_name} "
          f"{row['sdpa_ms']:9.2f} ms  ratio {row['ratio']:.3f}", flush=True)
    return row


def _device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return f"cpu-{platform.machine()}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dense", nargs="*", default=list(DENSE), choices=list(DENSE))
    p.add_argument("--packed", nargs="*", default=list(PACKED), choices=list(PACKED))
    p.add_argument("--backend", default="auto", help="kernels backend for 'ours'")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rows = []
    for name in args.dense:
        batch, seq = DENSE[name]
        rows.append(_case(name, "dense", [seq], batch, _ours(None, args.backend), _sdpa, args, device, dtype))
    for name in args.packed:
        lengths = PACKED[name]
        segments = Segments.from_cu_seqlens(torch.tensor([0] + lengths).cumsum(0))
        rows.append(_case(name, "packed", lengths, 1, _ours(segments, args.backend), _sdpa_per_sample(lengths),
                          args, device, dtype))

    os.makedirs(args.out_dir, exist_ok=True)
    out_path = os.path.join(args.out_dir, f"attention_speed_{_device_name(device)}.json")
    command = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS",) if k in os.environ)
    with open(out_path, "w") as f:
        json.dump({"command": f"{command} python {' '.join(sys.argv)}".strip(), "rows": rows}, f, indent=1)
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
