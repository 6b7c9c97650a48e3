"""Forward+backward time of each context-parallel attention method against single-device attention.

Spawns ``--degree`` processes (gloo on CPU; NCCL with one GPU per rank when enough GPUs exist),
times ``--iters`` fwd+bwd calls per method and sequence length after ``--warmup`` calls, and
reports the median over iterations of the slowest rank. The baseline is the same attention on
the full sequence in one process (``kernels.local_attention``, same backend).

    python benchmarks/attention_speed.py --seq 512 1024 --heads 4 --head-dim 32 --degree 2

Prints one JSON line per (method, seq) and writes all of them to
``benchmarks/results/attention_speed_<device>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import CP_METHODS, build_hybrid_groups, context_parallel_attention, local_attention  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, warmup, iters, group=None):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fwd_bwd(attn, q, k, v):
    def step():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        out = attn(qs, ks, vs)
        out.backward(torch.ones_like(out))
    return step


def _worker(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    hybrid = build_hybrid_groups(list(range(world)), args.a2a_size) if "a2a+p2p" in args.methods else (None, None)
    rows = []
    for seq in args.seq:
        if seq % world:
            raise SystemExit(f"--seq {seq} is not divisible by --degree {world}")
        g = torch.Generator().manual_seed(seq)
        full = [torch.randn(args.batch, seq, h, args.head_dim, generator=g).to(device, dtype)
                for h in (args.heads, args.kv_heads, args.kv_heads)]
        base = None
        if rank == 0:
            base = _time(_fwd_bwd(lambda q, k, v: local_attention(q, k, v, backend=args.backend), *full),
                         device, args.warmup, args.iters)
        s_local = seq // world
        local = [t[:, rank * s_local:(rank + 1) * s_local].contiguous() for t in full]
        for method in args.methods:
            def attn(q, k, v, method=method):
                return context_parallel_attention(q, k, v, method=method, cp_group=dist.group.WORLD,
                                                  a2a_group=hybrid[0], p2p_group=hybrid[1], backend=args.backend)
            t = torch.tensor(_time(_fwd_bwd(attn, *local), device, args.warmup, args.iters, dist.group.WORLD))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rank == 0:
                rows.append(dict(method=method, seq=seq, degree=world, batch=args.batch, heads=args.heads,
                                 kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                                 backend=args.backend, device=_device_name(device),
                                 fwd_bwd_ms=round(1e3 * t.item(), 3), single_device_ms=round(1e3 * base, 3),
                                 speedup_vs_single=round(base / t.item(), 3)))
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return f"cpu-{platform.machine()}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024], help="global sequence lengths")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA kv heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--degree", type=int, default=2, help="context-parallel degree (processes)")
    p.add_argument("--a2a-size", type=int, default=None, help="Ulysses size for a2a+p2p (default: degree // 2)")
    p.add_argument("--methods", nargs="+", default=["p2p", "a2a", "all_gather"], choices=CP_METHODS)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process (gloo runs)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    args.a2a_size = args.a2a_size or max(1, args.degree // 2)

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.degree
    device = _device_name(torch.device("cuda", 0) if use_cuda else torch.device("cpu"))
    os.makedirs(args.out_dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(args.degree, port, args, tmp_path), nprocs=args.degree, join=True,
                           start_method="spawn")
        with open(tmp_path) as f:
            rows = json.load(f)
    out_path = os.path.join(args.out_dir, f"attention_speed_{device}.json")
    with open(out_path, "w") as f:
        json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
