"""Bytes each rank sends per attention layer, measured with ``kernels.count_comm`` next to the formulas.

Spawns ``--degree`` gloo processes on CPU, runs every context-parallel method forward and
forward+backward under the counter, and prints one JSON line per method with the measured bytes
(the maximum over ranks) beside the analytic volume. Bytes do not depend on speed, so the CPU
numbers hold for NCCL too (same code path, same byte model: see ``kernels/comm_counter.py``).

    python benchmarks/attention_comm.py --seq 1024 --heads 8 --head-dim 32 --degree 4 --frames 8

N = seq * batch tokens, C = heads * head_dim, C_kv = kv_heads * head_dim, b = bytes per element,
a = bytes of the fp32 gradient accumulators (4; 8 for float64), P = degree, U x R = the a2a+p2p
split. ST rows use a video of ``--frames`` T x S = seq / T positions; hidden size C.

=================  ==========================================  ================================
method             forward                                     backward (added)
=================  ==========================================  ================================
p2p (ring)         2 N C_kv b (P-1)/P                          same again + dK|dV: 2 N C_kv a
a2a (Ulysses)      (2C + 2C_kv) N b (P-1)/P^2                  same again
all_gather         2 N C_kv b (P-1)/P                          same again + reduce-scatter dK|dV:
                                                               2 N C_kv a (P-1)/P
a2a+p2p (USP)      (2C + 2C_kv) N b (U-1)/(U P)                same again + 2 N C_kv a / U
                   + 2 N C_kv b (R-1)/P
st_dsp             pair spatial+temporal on hidden states,     same again
                   resident S-sharded: 2 N C b (P-1)/P^2
st_dsp_overlap     as st_dsp, each switch cut into --chunks    same again
st_qkv_spatial     one spatial attention on q|k|v:             same again
                   (2C + 2C_kv) N b (P-1)/P^2
st_mesh            pair on an R x U mesh (frames x Ulysses):   same again
                   (2C + 2C_kv) N b (U-1)/(U P)
                   + 2 N C b (R-1)/(R P)
=================  ==========================================  ================================

The ST formulas assume T and S divide the degrees; otherwise the switches send their zero
padding and the measured bytes exceed the formula (they use padded blocks ceil(T/P), ceil(S/P)).
Writes ``benchmarks/results/attention_comm_cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dit_mcore.kernels import (CP_METHODS, STLayout, build_hybrid_groups, context_parallel_attention,  # noqa: E402
                     count_comm, make_st_mesh, spatial_attention, st_attention)

ST_METHODS = ("st_dsp", "st_dsp_overlap", "st_qkv_spatial", "st_mesh")


@dataclass(frozen=True)
class CommBenchConfig:
    """One benchmark case (identical on every rank)."""

    seq: int
    """Global tokens per sample (for ST: frames * positions)."""
    heads: int
    """Query heads h."""
    head_dim: int
    """Channels per head d (C = h * d)."""
    degree: int
    """Context-parallel degree P (processes)."""
    frames: int = 1
    """Frames T of the ST video (S = seq // T)."""
    kv_heads: int | None = None
    """GQA kv heads (None: = heads)."""
    batch: int = 1
    """Samples per micro-batch."""
    a2a_size: int | None = None
    """Ulysses size U of a2a+p2p and of the st_mesh inner group (None: 2 when P > 2 and even, else P)."""
    chunks: int = 2
    """Chunks of the overlapped ST switch."""
    dtype: str = "float32"
    """Element type of q/k/v and hidden states."""

    @property
    def hk(self) -> int:
        return self.kv_heads or self.heads

    @property
    def U(self) -> int:
        if self.a2a_size:
            return self.a2a_size
        return 2 if self.degree > 2 and self.degree % 2 == 0 else self.degree

    def methods(self) -> list[str]:
        return list(CP_METHODS) + list(ST_METHODS)


def analytic(method: str, cfg: CommBenchConfig) -> tuple[float, float, str]:
    """``(fwd bytes, fwd+bwd bytes, formula)`` per rank for ``method`` (see the module table)."""
    P, U = cfg.degree, cfg.U
    R = P // U
    N, C, Ckv = cfg.seq * cfg.batch, cfg.heads * cfg.head_dim, cfg.hk * cfg.head_dim
    b = torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()
    a = 8 if cfg.dtype == "float64" else 4
    qkvo = (2 * C + 2 * Ckv) * N * b
    if method == "p2p":
        f = 2 * N * Ckv * b * (P - 1) / P
        return f, 2 * f + 2 * N * Ckv * a * (P > 1), "2 N C_kv b (P-1)/P"
    if method == "a2a":
        f = qkvo * (P - 1) / P ** 2
        return f, 2 * f, "(2C + 2C_kv) N b (P-1)/P^2"
    if method == "all_gather":
        f = 2 * N * Ckv * b * (P - 1) / P
        return f, 2 * f + 2 * N * Ckv * a * (P - 1) / P, "2 N C_kv b (P-1)/P"
    if method == "a2a+p2p":
        a2a = qkvo * (U - 1) / (U * P)
        ring = 2 * N * Ckv * b * (R - 1) / P
        return a2a + ring, 2 * (a2a + ring) + 2 * N * Ckv * a / U * (R > 1), \
            "(2C + 2C_kv) N b (U-1)/(U P) + 2 N C_kv b (R-1)/P"
    if method in ("st_dsp", "st_dsp_overlap"):
        f = 2 * N * C * b * (P - 1) / P ** 2
        return f, 2 * f, "2 N C b (P-1)/P^2 (pair)"
    if method == "st_qkv_spatial":
        f = qkvo * (P - 1) / P ** 2
        return f, 2 * f, "(2C + 2C_kv) N b (P-1)/P^2"
    if method == "st_mesh":
        f = qkvo * (U - 1) / (U * P) + 2 * N * C * b * (R - 1) / (R * P)
        return f, 2 * f, "(2C + 2C_kv) N b (U-1)/(U P) + 2 N C b (R-1)/(R P) (pair)"
    raise ValueError(f"unknown method {method!r}")


class _Linear:
    """Per-token projections with fixed weights (bytes do not depend on them)."""

    def __init__(self, cfg: CommBenchConfig, dtype, gen):
        C, d, h, hk = cfg.heads * cfg.head_dim, cfg.head_dim, cfg.heads, cfg.hk
        self.w_qkv = (torch.randn(C, (h + 2 * hk) * d, generator=gen) / C ** 0.5).to(dtype).requires_grad_()
        self.w_o = (torch.randn(h * d, C, generator=gen) / C ** 0.5).to(dtype).requires_grad_()
        self.h, self.hk, self.d = h, hk, d

    def qkv(self, x):
        return (x @ self.w_qkv).unflatten(-1, (self.h + 2 * self.hk, self.d)).split([self.h, self.hk, self.hk], -2)

    def out(self, o):
        return o.flatten(-2) @ self.w_o


def _count(run):
    """Run ``run() -> output`` under the counter: (fwd summary, fwd+bwd summary) of this rank."""
    with count_comm() as fwd:
        out = run()
    with count_comm() as bwd:
        out.backward(torch.ones_like(out))
    total = {}
    for s in (fwd.summary(), bwd.summary()):
        for op, v in s.items():
            t = total.setdefault(op, {"calls": 0, "bytes_sent": 0})
            t["calls"] += v["calls"]
            t["bytes_sent"] += v["bytes_sent"]
    return fwd.summary(), total


def measure(rank: int, world: int, cfg: CommBenchConfig) -> dict[str, tuple[dict, dict]]:
    """On each rank of an initialised group of ``cfg.degree``: ``{method: (fwd, fwd+bwd)}`` summaries."""
    if world != cfg.degree:
        raise ValueError(f"measure: run on {cfg.degree} ranks (--degree), got {world}")
    if cfg.seq % cfg.degree or cfg.seq % cfg.frames:
        raise ValueError(f"--seq {cfg.seq} must be divisible by --degree {cfg.degree} and --frames {cfg.frames}")
    if cfg.degree % cfg.U:
        raise ValueError(f"--a2a-size {cfg.U} must divide --degree {cfg.degree}")
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator().manual_seed(0)
    world_group = dist.group.WORLD
    hybrid = build_hybrid_groups(list(range(world)), cfg.U)
    mesh = make_st_mesh(None, outer=world // cfg.U, inner=cfg.U)
    s_local = cfg.seq // world
    results = {}

    def tokens(n, heads=None):
        shape = (cfg.batch, n, heads, cfg.head_dim) if heads else (cfg.batch, n, cfg.heads * cfg.head_dim)
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    for method in CP_METHODS:
        q, k, v = tokens(s_local, cfg.heads), tokens(s_local, cfg.hk), tokens(s_local, cfg.hk)
        results[method] = _count(lambda: context_parallel_attention(
            q, k, v, method=method, cp_group=world_group, a2a_group=hybrid[0], p2p_group=hybrid[1]))

    grid = (cfg.frames, cfg.seq // cfg.frames)
    proj = _Linear(cfg, dtype, gen)
    dsp = STLayout(grid=grid, group=world_group, sharded="S")
    for method, chunks in (("st_dsp", 1), ("st_dsp_overlap", cfg.chunks)):
        x = dsp.shard(tokens(cfg.seq)).detach().requires_grad_()

        def pair(x=x, chunks=chunks):
            y = st_attention(x, kind="spatial", layout=dsp, qkv_proj=proj.qkv, out_proj=proj.out, chunks=chunks)
            return st_attention(y, kind="temporal", layout=dsp, qkv_proj=proj.qkv, out_proj=proj.out)

        results[method] = _count(pair)
    q, k, v = (dsp.shard(tokens(cfg.seq, h)).detach().requires_grad_() for h in (cfg.heads, cfg.hk, cfg.hk))
    results["st_qkv_spatial"] = _count(lambda: spatial_attention(q, k, v, layout=dsp))
    two_level = STLayout(grid=grid, group=mesh[0], sharded="T", inner_group=mesh[1])
    x = two_level.shard(tokens(cfg.seq)).detach().requires_grad_()

    def mesh_pair():
        y = st_attention(x, kind="spatial", layout=two_level, qkv_proj=proj.qkv, out_proj=proj.out)
        return st_attention(y, kind="temporal", layout=two_level, qkv_proj=proj.qkv, out_proj=proj.out,
                            chunks=cfg.chunks)

    results["st_mesh"] = _count(mesh_pair)
    return results


def rows(cfg: CommBenchConfig, per_rank: list[dict]) -> list[dict]:
    """One row per method: max-over-ranks measured bytes, calls and the analytic volume."""
    out = []
    for method in per_rank[0]:
        fwd = [sum(v["bytes_sent"] for v in r[method][0].values()) for r in per_rank]
        tot = [sum(v["bytes_sent"] for v in r[method][1].values()) for r in per_rank]
        a_fwd, a_tot, formula = analytic(method, cfg)
        out.append(dict(method=method, **{k: v for k, v in asdict(cfg).items() if k not in ("kv_heads", "a2a_size")},
                        kv_heads=cfg.hk, a2a_size=cfg.U,
                        fwd_bytes=max(fwd), fwd_bwd_bytes=max(tot), uniform_over_ranks=len(set(fwd)) == 1,
                        analytic_fwd_bytes=a_fwd, analytic_fwd_bwd_bytes=a_tot, formula=formula,
                        fwd_ops=per_rank[0][method][0], fwd_bwd_ops=per_rank[0][method][1]))
    return out


def _worker(rank, world, port, cfg, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(measure(rank, world, cfg), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=512, help="global tokens per sample (ST: frames * positions)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA kv heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--degree", type=int, default=4, help="context-parallel degree (gloo processes)")
    p.add_argument("--frames", type=int, default=8, help="frames T of the ST video (S = seq / T)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--a2a-size", type=int, default=None, help="Ulysses size U (a2a+p2p, st_mesh)")
    p.add_argument("--chunks", type=int, default=2, help="chunks of the overlapped ST switch")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "attention_comm_cpu.json"))
    args = p.parse_args(argv)
    cfg = CommBenchConfig(seq=args.seq, heads=args.heads, head_dim=args.head_dim, degree=args.degree,
                          frames=args.frames, kv_heads=args.kv_heads, batch=args.batch, a2a_size=args.a2a_size,
                          chunks=args.chunks, dtype=args.dtype)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(cfg.degree, port, cfg, tmp), nprocs=cfg.degree, join=True,
                           start_method="spawn")
        per_rank = [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(cfg.degree)]
    table = rows(cfg, per_rank)
    for row in table:
        print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/attention_comm.py " + " ".join(sys.argv[1:]), "device": "cpu (gloo)",
                   "rows": table}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
