"""Context-parallel attention (every method, dense + packed) against a single-process float64 reference.

One gloo spawn per world size runs every case; the child returns its local shards of out, lse
and dq/dk/dv, the parent stitches the shards and compares with float64 attention computed per
sample on the unpadded tokens. Every method runs with an out-only loss (the backward on the fused
kernels); the ``_lse_grad`` cases also weight lse (the backward that takes a gradient on lse).
Also checked: padding rows give out 0, lse -inf and exactly zero gradients, collective counts per
call, and bad configurations raise ValueError.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from dit_mcore.kernels import (build_hybrid_groups, context_parallel_attention, cross_attention, split_packed_for_cp)
from dit_mcore.kernels.all_gather import all_gather_attention

TOL = dict(rtol=1e-5, atol=2e-6)
B, S_LOCAL, H, HK, D = 2, 3, 4, 2, 8          # dense case (GQA 2:1)
PACKED_LENS = [5, 1, 9, 3]                    # uneven samples; padded per sample and at the tail
PAD_MULTIPLE = 3                              # 21 padded tokens: inner padding, plus tail padding for P > 1
PACKED_H, PACKED_HK = 4, 1                    # GQA 4:1 (Ulysses replicates kv heads when P > 1)
TEXT_LENS = [2, 3, 1, 4]
LSE_GRAD = "_lse_grad"                        # result keys whose loss also weights lse


def _tensors(seed, b, s, h, hk, d):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=g) for n in (h, hk, hk))
    w_out = torch.randn(b, s, h, d, generator=g)
    w_lse = torch.randn(b, h, s, generator=g)
    return q, k, v, w_out, w_lse


def _loss(out, lse, w_out, w_lse):
    """Weighted out, plus weighted lse when ``w_lse`` is given. Without it no gradient reaches lse
    and the backward runs on the fused kernels; with it, on the math path that takes one."""
    loss = (out * w_out).sum()
    if w_lse is None:
        return loss
    # lse is -inf on padding rows: weight only the finite entries
    return loss + torch.where(torch.isfinite(lse), lse * w_lse, torch.zeros_like(lse)).sum()


def _run(fn, q, k, v, w_out, w_lse, sl, **kwargs):
    """Local shards in, (out, lse, dq, dk, dv) of this rank out."""
    qs, ks, vs = (t[:, sl].clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(qs, ks, vs, **kwargs)
    _loss(out, lse, w_out[:, sl], None if w_lse is None else w_lse[:, :, sl]).backward()
    return [t.detach() for t in (out, lse, qs.grad, ks.grad, vs.grad)]


def _count_calls(monkeypatch_ops):
    counts = {}
    originals = {}
    for name in monkeypatch_ops:
        originals[name] = getattr(dist, name)

        def wrapper(*a, __name=name, **kw):
            counts[__name] = counts.get(__name, 0) + 1
            return originals[__name](*a, **kw)
        setattr(dist, name, wrapper)
    return counts, originals


_OPS = ("all_to_all_single", "batch_isend_irecv", "all_gather_into_tensor", "reduce_scatter_tensor")


def _child(rank, world):
    group = dist.group.WORLD
    res = {"dense": {}, "packed": {}, "counts": {}, "errors": {}}
    hybrid = {}
    for inner in sorted({1, world} | ({2} if world % 2 == 0 else set())):
        hybrid[inner] = build_hybrid_groups(list(range(world)), inner)

    # ---- dense ----
    q, k, v, w_out, w_lse = _tensors(0, B, S_LOCAL * world, H, HK, D)
    sl = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    for method in ("p2p", "a2a", "all_gather"):
        for suffix, w in (("", None), (LSE_GRAD, w_lse)):
            res["dense"][method + suffix] = _run(context_parallel_attention, q, k, v, w_out, w, sl, method=method,
                                                 cp_group=group, return_lse=True)
    res["dense"]["all_gather_stride1"] = _run(all_gather_attention, q, k, v, w_out, None, sl, group=group,
                                              softmax_scale=D ** -0.5, kv_head_stride=1)
    res["dense"]["p2p_math64"] = _run(context_parallel_attention, q, k, v, w_out, None, sl, method="p2p",
                                      cp_group=group, return_lse=True, backend="math64")
    for inner, (a2a_g, p2p_g) in hybrid.items():
        res["dense"][f"a2a+p2p_{inner}"] = _run(context_parallel_attention, q, k, v, w_out, None, sl,
                                                method="a2a+p2p", cp_group=group, a2a_group=a2a_g,
                                                p2p_group=p2p_g, return_lse=True)

    # ---- packed, padded layout ----
    cu = torch.tensor([0] + PACKED_LENS).cumsum(0).to(torch.int32)
    layout = split_packed_for_cp(cu, world, multiple=PAD_MULTIPLE)
    q, k, v, w_out, w_lse = _tensors(1, 1, layout.total_len, PACKED_H, PACKED_HK, D)
    sl = slice(*layout.shard_range(rank))
    packed = dict(cp_group=group, cu_seqlens=layout.cu_seqlens, cu_seqlens_padded=layout.cu_seqlens_padded,
                  return_lse=True)
    for method in ("p2p", "a2a", "all_gather"):
        res["packed"][method] = _run(context_parallel_attention, q, k, v, w_out, None, sl, method=method, **packed)
    res["packed"]["p2p" + LSE_GRAD] = _run(context_parallel_attention, q, k, v, w_out, w_lse, sl, method="p2p",
                                           **packed)
    for inner, (a2a_g, p2p_g) in hybrid.items():
        res["packed"][f"a2a+p2p_{inner}"] = _run(context_parallel_attention, q, k, v, w_out, None, sl,
                                                 method="a2a+p2p", a2a_group=a2a_g, p2p_group=p2p_g, **packed)
    # cross-attention of the local query shard to replicated text K/V, one text per sample
    text_cu = torch.tensor([0] + TEXT_LENS).cumsum(0).to(torch.int32)
    _, kt, vt, _, _ = _tensors(2, 1, int(text_cu[-1]), PACKED_H, PACKED_HK, D)
    cu_local, cu_local_padded = layout.local_cu_seqlens(rank)
    kt_full, vt_full = kt.clone().requires_grad_(), vt.clone().requires_grad_()
    qs = q[:, sl].clone().requires_grad_()
    out, lse = cross_attention(qs, kt_full, vt_full, cu_seqlens_q_local=cu_local, cu_seqlens_kv=text_cu,
                               cu_seqlens_q_local_padded=cu_local_padded, return_lse=True)
    _loss(out, lse, w_out[:, sl], None).backward()
    res["cross"] = [t.detach() for t in (out, lse, qs.grad, kt_full.grad, vt_full.grad)]

    # ---- collective counts, dense case ----
    q, k, v, w_out, w_lse = _tensors(0, B, S_LOCAL * world, H, HK, D)
    sl = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    for method, kwargs in (("p2p", {}), ("a2a", {}), ("all_gather", {})):
        qs, ks, vs = (t[:, sl].clone().requires_grad_() for t in (q, k, v))
        counts, originals = _count_calls(_OPS)
        try:
            out = context_parallel_attention(qs, ks, vs, method=method, cp_group=group, **kwargs)
            fwd = dict(counts)
            (out * w_out[:, sl]).sum().backward()
            res["counts"][method] = (fwd, {n: counts.get(n, 0) - fwd.get(n, 0) for n in counts})
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    # ---- bad configurations ----
    def error_of(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    x = torch.randn(1, 2, 3, 4)
    res["errors"]["heads"] = error_of(lambda: context_parallel_attention(x, x, x, method="a2a", cp_group=group))
    res["errors"]["empty"] = error_of(lambda: context_parallel_attention(
        x[:, :0], x[:, :0], x[:, :0], method="p2p", cp_group=group))
    res["errors"]["method"] = error_of(lambda: context_parallel_attention(x, x, x, method="ring", cp_group=group))
    res["errors"]["batch"] = error_of(lambda: context_parallel_attention(
        x.expand(2, -1, -1, -1), x.expand(2, -1, -1, -1), x.expand(2, -1, -1, -1), method="p2p", cp_group=group,
        cu_seqlens=torch.tensor([0, 2], dtype=torch.int32)))
    res["errors"]["cu_too_long"] = error_of(lambda: context_parallel_attention(
        x, x, x, method="p2p", cp_group=group, cu_seqlens=torch.tensor([0, 2 * world + 1], dtype=torch.int32)))
    res["errors"]["no_groups"] = error_of(lambda: context_parallel_attention(
        x, x, x, method="a2a+p2p", cp_group=group))
    if world > 1:
        a2a_g, _ = hybrid[world]
        res["errors"]["product"] = error_of(lambda: context_parallel_attention(
            x, x, x, method="a2a+p2p", cp_group=group, a2a_group=a2a_g, p2p_group=a2a_g))
    return res


# ------------------------------------------------------------------ reference (parent, float64)


def _reference(q, k, v, w_out, w_lse, q_segs, kv_segs):
    """float64 per-sample attention; q_segs/kv_segs are lists of index tensors (one per sample)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float64)
    for qi, ki in zip(q_segs, kv_segs):
        kk, vv = (t[:, ki].repeat_interleave(rep, dim=2) for t in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, qi], kk) / d ** 0.5
        out = out.index_copy(1, qi, torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv))
        lse = lse.index_copy(2, qi, torch.logsumexp(scores, -1))
    _loss(out, lse, w_out.double(), None if w_lse is None else w_lse.double()).backward()
    return [t.detach() for t in (out, lse, q.grad, k.grad, v.grad)]


def _stitch(per_rank, key, method):
    shards = [r[key][method] for r in per_rank]
    return [torch.cat([s[i] for s in shards], dim=2 if i == 1 else 1) for i in range(5)]


def _compare(got, ref, label):
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(g.double(), r, **TOL, msg=lambda m: f"{label} {name}: {m}")


def _check_world(world):
    per_rank = run_distributed(_child, world)

    q, k, v, w_out, w_lse = _tensors(0, B, S_LOCAL * world, H, HK, D)
    full = [torch.arange(S_LOCAL * world)]
    refs = {w is not None: _reference(q, k, v, w_out, w, full, full) for w in (None, w_lse)}
    for method in per_rank[0]["dense"]:
        _compare(_stitch(per_rank, "dense", method), refs[method.endswith(LSE_GRAD)], f"dense P={world} {method}")

    cu = torch.tensor([0] + PACKED_LENS).cumsum(0).to(torch.int32)
    layout = split_packed_for_cp(cu, world, multiple=PAD_MULTIPLE)
    q, k, v, w_out, w_lse = _tensors(1, 1, layout.total_len, PACKED_H, PACKED_HK, D)
    segs = [torch.arange(int(s), int(s) + n) for s, n in zip(layout.cu_seqlens_padded[:-1], PACKED_LENS)]
    refs = {w is not None: _reference(q, k, v, w_out, w, segs, segs) for w in (None, w_lse)}
    pad = ~layout.is_real()
    assert pad.any(), "the packed case must contain padding"
    for method in per_rank[0]["packed"]:
        got = _stitch(per_rank, "packed", method)
        _compare(got, refs[method.endswith(LSE_GRAD)], f"packed P={world} {method}")
        out, lse, dq, dk, dv = got
        assert torch.isneginf(lse[:, :, pad]).all()
        for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert torch.count_nonzero(t[:, pad]) == 0, f"packed P={world} {method}: {name} nonzero on padding"

    # cross-attention: text grads are summed over ranks, query outputs stitched
    text_cu = torch.tensor([0] + TEXT_LENS).cumsum(0)
    _, kt, vt, _, _ = _tensors(2, 1, int(text_cu[-1]), PACKED_H, PACKED_HK, D)
    text_segs = [torch.arange(int(a), int(b)) for a, b in zip(text_cu[:-1], text_cu[1:])]
    ref = _reference(q, kt, vt, w_out, None, segs, text_segs)
    cross = [r["cross"] for r in per_rank]
    got = [torch.cat([c[0] for c in cross], 1), torch.cat([c[1] for c in cross], 2),
           torch.cat([c[2] for c in cross], 1), sum(c[3] for c in cross), sum(c[4] for c in cross)]
    _compare(got, ref, f"cross P={world}")

    fwd, bwd = per_rank[0]["counts"]["p2p"]
    if world > 1:
        # ring: P-1 K/V steps forward; backward P-1 K/V steps plus P dK/dV hops
        assert fwd == {"batch_isend_irecv": world - 1}, fwd
        assert bwd == {"batch_isend_irecv": 2 * world - 1}, bwd
        fwd, bwd = per_rank[0]["counts"]["a2a"]
        assert fwd == {"all_to_all_single": 2} and bwd == {"all_to_all_single": 2}, (fwd, bwd)
        fwd, bwd = per_rank[0]["counts"]["all_gather"]
        assert fwd == {"all_gather_into_tensor": 1}, fwd
        assert bwd == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, bwd
    else:
        assert all(not f and not b for f, b in per_rank[0]["counts"].values())

    errors = per_rank[0]["errors"]
    if world > 1:
        assert "heads" in errors["heads"] and "divide" in errors["heads"]
        assert "a2a_group size" in errors["product"]
    assert "shorter than the CP degree" in errors["empty"]
    assert "unknown" in errors["method"]
    assert "batch size 1" in errors["batch"]
    assert "GLOBAL" in errors["cu_too_long"]
    assert "a2a_group and p2p_group" in errors["no_groups"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_context_parallel_matches_reference(world):
    _check_world(world)
