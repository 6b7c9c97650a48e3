"""Spatial-temporal attention on 1, 2 and 4 gloo ranks (and a 2x2 mesh) against float64 references.

Every rank builds the same full tensors, computes the single-process float64 reference, runs the
parallel path on its resident shard and reports errors; assertions run in the parent.
"""
import pytest
import torch

from dist_utils import run_distributed
from dit_mcore.kernels.comm_counter import count_comm
from dit_mcore.kernels.spatial_temporal import (STLayout, make_st_mesh, spatial_attention, st_attention,
                                      temporal_attention)
from dit_mcore.kernels.st_switch import block_size, switch_shard

B, H, HK, D, C = 2, 4, 2, 8, 16
F32 = 4
TOL = 2e-5


def ref_attention(q, k, v, grid, kind):
    """Full per-frame (spatial) or per-position (temporal) attention in float64."""
    T, S = grid
    b, _, h, d = q.shape
    k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
    q5, k5, v5 = (t.reshape(b, T, S, h, d) for t in (q, k, v))
    if kind == "temporal":
        q5, k5, v5 = (t.transpose(1, 2) for t in (q5, k5, v5))
    p = torch.softmax(torch.einsum("bxqhd,bxkhd->bxhqk", q5, k5) / d ** 0.5, dim=-1)
    o = torch.einsum("bxhqk,bxkhd->bxqhd", p, v5)
    if kind == "temporal":
        o = o.transpose(1, 2)
    return o.reshape(b, T * S, h, d)


class Projections:
    """Per-token QKV and output projections (Linear + bias) shared by every rank."""

    def __init__(self, gen, heads=H, kv_heads=HK):
        self.h, self.hk = heads, kv_heads
        self.w_qkv = torch.randn(C, (heads + 2 * kv_heads) * D, generator=gen, dtype=torch.float64) / C ** 0.5
        self.b_qkv = torch.randn((heads + 2 * kv_heads) * D, generator=gen, dtype=torch.float64)
        self.w_o = torch.randn(heads * D, C, generator=gen, dtype=torch.float64) / (heads * D) ** 0.5
        self.b_o = torch.randn(C, generator=gen, dtype=torch.float64)

    def params(self, dtype):
        return [p.detach().to(dtype).clone().requires_grad_() for p in (self.w_qkv, self.b_qkv, self.w_o, self.b_o)]

    def fns(self, params):
        w_qkv, b_qkv, w_o, b_o = params

        def qkv_proj(x):
            y = (x @ w_qkv + b_qkv).unflatten(-1, (self.h + 2 * self.hk, D))
            return y.split([self.h, self.hk, self.hk], dim=-2)

        def out_proj(o):
            return o.flatten(-2) @ w_o + b_o

        return qkv_proj, out_proj


def _err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _qkv_case(report, layout, kind, gen, label, heads=H, kv_heads=HK):
    """Functional q/k/v path: out and dq/dk/dv vs the float64 reference; comm of the forward."""
    T, S = layout.grid
    full = [torch.randn(B, T * S, n, D, generator=gen, dtype=torch.float64) for n in (heads, kv_heads, kv_heads)]
    dout = torch.randn(B, T * S, heads, D, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in full]
    ref = ref_attention(*ref_in, layout.grid, kind)
    ref.backward(dout)
    local = [layout.shard(t).float().requires_grad_() for t in full]
    fn = spatial_attention if kind == "spatial" else temporal_attention
    with count_comm() as fwd:
        out = fn(*local, layout=layout)
    with count_comm() as bwd:
        out.backward(layout.shard(dout).float())
    report.err(f"{label} out", out, layout.shard(ref))
    for name, t, r in zip("qkv", local, ref_in):
        report.err(f"{label} d{name}", t.grad, layout.shard(r.grad))
    return fwd, bwd


def _hidden_case(report, layout, kind, gen, label, chunks=(1, 2, 3)):
    """Hidden-state path for each chunk count: out, dx and param grads (summed over ranks later)."""
    T, S = layout.grid
    proj = Projections(gen)
    x_full = torch.randn(B, T * S, C, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, T * S, C, generator=gen, dtype=torch.float64)
    x_ref = x_full.clone().requires_grad_()
    params_ref = proj.params(torch.float64)
    qkv_ref, out_ref = proj.fns(params_ref)
    y_ref = out_ref(ref_attention(*qkv_ref(x_ref), layout.grid, kind))
    y_ref.backward(dy)
    first = None
    comms = {}
    for k in chunks:
        params = proj.params(torch.float32)
        qkv_proj, out_proj = proj.fns(params)
        x = layout.shard(x_full).float().requires_grad_()
        with count_comm() as fwd:
            y = st_attention(x, kind=kind, layout=layout, qkv_proj=qkv_proj, out_proj=out_proj, chunks=k)
        with count_comm() as bwd:
            y.backward(layout.shard(dy).float())
        comms[k] = (fwd, bwd)
        report.err(f"{label} chunks={k} out", y, layout.shard(y_ref))
        report.err(f"{label} chunks={k} dx", x.grad, layout.shard(x_ref.grad))
        report.partial(f"{label} chunks={k} dparams", [p.grad for p in params], [p.grad for p in params_ref])
        if first is None:
            first = (y.detach(), x.grad)
        else:
            report.same(f"{label} chunks={k} == chunks=1 (out)", y.detach(), first[0])
            report.same(f"{label} chunks={k} == chunks=1 (dx)", x.grad, first[1])
    return comms


class Report:
    def __init__(self):
        self.errors, self.equal, self.partials = [], [], []

    def err(self, label, got, want):
        self.errors.append((label, _err(got, want)))

    def same(self, label, got, want):
        """Bitwise equal (the overlapped path moves the same data and computes per sequence)."""
        self.equal.append((label, _err(got, want), 0.0))

    def eq(self, label, got, want):
        self.equal.append((label, got, want))

    def partial(self, label, got, want):
        """Per-rank contributions that must sum (over ranks) to ``want``."""
        self.partials.append((label, [g.double() for g in got], want))


def _switch_padding(report, P, rank, group=None):
    """switch_shard: padded rows are zero, their grads dropped, round trip exact, one a2a."""
    T, S = 3, 5
    x_full = torch.arange(T * S * 2, dtype=torch.float32).reshape(T, S, 2) + 1
    t0, t1 = min(rank * block_size(T, P), T), min((rank + 1) * block_size(T, P), T)
    x = x_full[t0:t1].clone().requires_grad_()
    with count_comm() as comm:
        y = switch_shard(x, from_dim=0, to_dim=1, sizes=(T, S), group=group)
    cS = block_size(S, P)
    s0, s1 = min(rank * cS, S), min((rank + 1) * cS, S)
    report.eq("switch shape", tuple(y.shape), (T, cS, 2))
    report.err("switch real rows", y[:, :s1 - s0], x_full[:, s0:s1])
    report.eq("switch padded rows are zero", bool((y[:, s1 - s0:] == 0).all()), True)
    if P > 1:
        report.eq("switch: one a2a", comm.summary(), {"all_to_all_single": {
            "calls": 1, "bytes_sent": (P - 1) * block_size(T, P) * cS * 2 * F32}})
    back = switch_shard(y, from_dim=1, to_dim=0, sizes=(S, T), group=group, keep_padding=False)
    report.err("switch round trip", back, x)
    (y * 7.0).sum().backward()  # weight 7 on every row, padded ones included
    report.err("switch grads: 7 on real rows only", x.grad, torch.full_like(x, 7.0))


def _a2a_calls(counter):
    return counter.summary().get("all_to_all_single", {"calls": 0, "bytes_sent": 0})


def _run(rank, world, mesh):
    import torch.distributed as dist

    torch.manual_seed(0)
    report = Report()
    P = world
    _switch_padding(report, P, rank)
    grids = [(3, 5), (4, 6), (1, 6)]
    for i, grid in enumerate(grids):
        for j, sharded in enumerate(("S", "T")):
            layout = STLayout(grid=grid, group=None, sharded=sharded)
            for kind in ("spatial", "temporal"):
                gen = torch.Generator().manual_seed(10 * i + 2 * j + len(kind))  # same data on every rank
                label = f"P={P} grid={grid} sharded={sharded} {kind}"
                fwd, bwd = _qkv_case(report, layout, kind, gen, label)
                switched = layout.plan(kind) == "switch"
                seq, bat = ((grid[1], grid[0]) if kind == "spatial" else grid)
                # q|k|v fused (2H... heads) one way, the output the other: padded blocks cA x cB
                want = (P - 1) * block_size(seq, P) * block_size(bat, P) * B * D * F32 * (2 * H + 2 * HK)
                report.eq(f"{label} fwd comm", _a2a_calls(fwd),
                          {"calls": 2, "bytes_sent": want} if switched else {"calls": 0, "bytes_sent": 0})
                report.eq(f"{label} bwd comm", _a2a_calls(bwd),
                          {"calls": 2, "bytes_sent": want} if switched else {"calls": 0, "bytes_sent": 0})
    # hidden states: a spatial+temporal pair in the DSP layout sends exactly 2 hidden-state switches
    for grid in [(4, 8), (3, 5)]:
        for sharded in ("S", "T"):
            layout = STLayout(grid=grid, sharded=sharded)
            pair = {}
            for kind in ("spatial", "temporal"):
                gen = torch.Generator().manual_seed(7 + len(pair))
                pair[kind] = _hidden_case(report, layout, kind, gen, f"P={P} grid={grid} sharded={sharded} x {kind}")
            T, S = grid
            one_switch = (P - 1) * block_size(T, P) * block_size(S, P) * B * C * F32
            for k in (1, 2, 3):
                fwd = [_a2a_calls(pair[kind][k][0]) for kind in pair]
                bwd = [_a2a_calls(pair[kind][k][1]) for kind in pair]
                n_switch = 2 if P > 1 else 0
                calls_per_switch = min(k, block_size(T if sharded == "S" else S, P))
                label = f"P={P} grid={grid} sharded={sharded} x-pair chunks={k}"
                report.eq(f"{label} fwd calls", sum(f["calls"] for f in fwd), n_switch * calls_per_switch)
                report.eq(f"{label} fwd bytes", sum(f["bytes_sent"] for f in fwd), n_switch * one_switch)
                report.eq(f"{label} bwd bytes", sum(f["bytes_sent"] for f in bwd), n_switch * one_switch)
                if T % P == 0 and S % P == 0:  # the note's DSP formula: 2 x N C b (P-1)/P^2
                    report.eq(f"{label} == DSP 2 switches", sum(f["bytes_sent"] for f in fwd),
                              2 * B * T * S * C * F32 * (P - 1) // P ** 2)
    if mesh:
        outer, inner = make_st_mesh(None, outer=2, inner=2)
        for grid in [(2, 6), (2, 5), (3, 7)]:  # degree 4 > T
            layout = STLayout(grid=grid, group=outer, sharded="T", inner_group=inner)
            for kind in ("spatial", "temporal"):
                gen = torch.Generator().manual_seed(11)
                label = f"mesh 2x2 grid={grid} {kind}"
                fwd, _ = _qkv_case(report, layout, kind, gen, label)
                a2a = [e for e in fwd.events if e.op == "all_to_all_single"]
                report.eq(f"{label} a2a calls (group sizes)", [e.group_size for e in a2a], [2, 2])
                _hidden_case(report, layout, kind, gen, f"{label} x", chunks=(1, 2))
        messages = []
        for bad in (lambda: make_st_mesh(None, outer=3, inner=2),
                    lambda: spatial_attention(*(torch.zeros(1, 3, 3, 4) for _ in range(3)),
                                              layout=STLayout(grid=(2, 6), group=outer, sharded="T",
                                                              inner_group=inner)),
                    lambda: STLayout(grid=(2, 6), group=outer, sharded="S", inner_group=inner),
                    lambda: STLayout(grid=(2, 6), group=outer, sharded="T", inner_group=outer)):
            try:
                bad()
                messages.append(None)
            except ValueError as e:
                messages.append(str(e))
        report.eq("bad configs raise", [m is not None for m in messages], [True] * 4)
        report.eq("bad config messages", [m.split(":")[0] for m in messages],
                  ["make_st_mesh", "two-level ST attention", "STLayout.inner_group (two-level mesh) needs sharded='T'",
                   "STLayout"])
    dist.barrier()
    return report.errors, report.equal, report.partials


def _check(results):
    for rank, (errors, equal, _) in enumerate(results):
        for label, e in errors:
            assert e <= TOL, f"rank {rank}: {label}: max abs error {e:.3g} > {TOL}"
        for label, got, want in equal:
            assert got == want, f"rank {rank}: {label}: got {got}, want {want}"
    partials = [r[2] for r in results]
    for i, (label, _, want) in enumerate(partials[0]):
        for j, w in enumerate(want):
            total = sum(p[i][1][j] for p in partials)
            assert _err(total, w) <= TOL, f"{label}[{j}]: summed over ranks, error {_err(total, w):.3g}"


@pytest.mark.parametrize("world,mesh", [(1, False), (2, False), (4, True)])
def test_spatial_temporal_matches_reference(world, mesh):
    _check(run_distributed(_run, world, mesh))
