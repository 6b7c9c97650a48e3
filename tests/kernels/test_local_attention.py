"""Local attention on the fused kernels (forward AND backward) against a float64 reference.

Covers dense and packed layouts (one strided run, several runs, padded slots, empty segments,
separate q/kv layouts), GQA, padding that must get out 0 / lse -inf / zero gradients, a
ring-style backward against a merged (out, lse), the gradient-on-lse path, the plans cached on
``Segments``, and, with emulated GPU ops, the varlen glue that only runs on CUDA.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

from attention_reference import reference_attention

import dit_mcore.kernels.attention_kernels as ak
from dit_mcore.kernels.local_attention import (Segments, attention_backward, attention_forward, local_attention,
                                               segment_attention)
from dit_mcore.kernels.attention_kernels import KERNELS, Kernel, resolve_backend
from dit_mcore.kernels.ring import merge_attention

CPU_BACKENDS = ["math64", "flash_cpu"]
TOL = dict(rtol=1e-5, atol=2e-6)


_reference = reference_attention


def _segments(cu_q, cu_kv=None, pad_q=None, pad_kv=None):
    return Segments.from_cu_seqlens(cu_q, cu_kv if cu_kv is not None else cu_q, pad_q, pad_kv)


# (b, s_q, s_kv, h, h_kv, segments)
CASES = {
    "dense_gqa": (2, 11, 13, 4, 2, None),
    "dense_mha": (1, 9, 9, 2, 2, None),
    "one_run_covering": (1, 15, 15, 4, 2, _segments([0, 5, 10, 15])),
    "runs_mixed_tail_pad": (1, 20, 20, 4, 1, _segments([0, 4, 8, 12, 15, 18])),
    "empty_segment": (1, 9, 9, 2, 2, _segments([0, 4, 4, 9])),
    "padded_slots_one_strided_run": (1, 13, 13, 4, 2, _segments([0, 3, 6, 9], None, [0, 4, 8, 12], [0, 4, 8, 12])),
    "cross_layouts": (1, 7, 9, 2, 1, _segments([0, 2, 5], [0, 4, 6], [0, 3, 6], None)),
    "shared_keys": (1, 6, 5, 2, 1, Segments((0, 3), (3, 6), (0, 0), (4, 4))),  # both samples read keys 0..3
    # padding between segments on both sides (varlen: the gaps run as segments, then are cleared)
    "padded_slots_varlen": (1, 13, 13, 4, 2, _segments([0, 3, 7, 9], None, [0, 4, 9, 12], [0, 4, 9, 12])),
    "cross_padded_gaps": (1, 10, 8, 2, 1, _segments([0, 3, 7], [0, 2, 5], [0, 4, 9], [0, 3, 6])),
    "key_gap_only": (1, 6, 6, 2, 1, _segments([0, 3, 6], [0, 2, 5], None, [0, 3, 6])),  # gathers
}


def _inputs(b, s_q, s_kv, h, hk, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h, d, generator=g).to(dtype)
    k, v = (torch.randn(b, s_kv, hk, d, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(b, s_q, h, d, generator=g).to(dtype)
    return q, k, v, dout


def _grads(fn, q, k, v, dout, use_lse=None):
    """Run ``fn`` on leaf copies, backprop ``dout`` (plus ``sum(lse * use_lse)`` where finite)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    loss = (out * dout.to(out.dtype)).sum()
    if use_lse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse * use_lse.to(lse.dtype), torch.zeros_like(lse)).sum()
    loss.backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def _unused_rows(segments, s_q, s_kv):
    q_used, k_used = torch.zeros(s_q, dtype=torch.bool), torch.zeros(s_kv, dtype=torch.bool)
    for a, e, c, f in segments.nonempty():
        q_used[a:e] = True
        k_used[c:f] = True
    return ~q_used, ~k_used


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("with_lse_grad", [False, True], ids=["fused_bwd", "lse_grad"])
def test_forward_and_backward_match_float64(backend, case, with_lse_grad):
    b, s_q, s_kv, h, hk, seg = CASES[case]
    q, k, v, dout = _inputs(b, s_q, s_kv, h, hk)
    w_lse = torch.randn(b, h, s_q, generator=torch.Generator().manual_seed(1)) if with_lse_grad else None
    out, lse, grads = _grads(lambda *t: segment_attention(*t, segments=seg, backend=backend), q, k, v, dout, w_lse)
    ref_out, ref_lse, ref_grads = _grads(lambda *t: _reference(*t, seg), q.double(), k.double(), v.double(),
                                         dout.double(), w_lse)
    torch.testing.assert_close(out.double(), ref_out, **TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **TOL)
    for name, got, ref in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got.double(), ref, **TOL, msg=lambda m: f"d{name}: {m}")
    if seg is not None:  # padding: out 0, lse -inf, gradients exactly 0
        pad_q, pad_k = _unused_rows(seg, s_q, s_kv)
        assert torch.isneginf(lse[:, :, pad_q]).all() and not out[:, pad_q].any()
        assert not grads[0][:, pad_q].any() and not grads[1][:, pad_k].any() and not grads[2][:, pad_k].any()


def test_bfloat16_on_the_cpu_flash_kernel():
    b, s_q, s_kv, h, hk, seg = CASES["runs_mixed_tail_pad"]
    q, k, v, dout = _inputs(b, s_q, s_kv, h, hk, d=16, dtype=torch.bfloat16)
    out, lse, grads = _grads(lambda *t: segment_attention(*t, segments=seg, backend="flash_cpu"), q, k, v, dout)
    ref_out, ref_lse, ref_grads = _grads(lambda *t: _reference(*t, seg), q.double(), k.double(), v.double(),
                                         dout.double())
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    loose = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref_out, **loose)
    torch.testing.assert_close(lse.double(), ref_lse, **loose)
    for got, ref in zip(grads, ref_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), ref, rtol=5e-2, atol=5e-2)


def test_backward_runs_the_fused_cpu_kernel_not_math():
    """With lse unused, the backward is the flash backward op: no einsum, no score matrix."""
    q, k, v, dout = _inputs(1, 12, 12, 4, 2)
    seg = _segments([0, 5, 12])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = local_attention(*leaves, cu_seqlens_q=torch.tensor([0, 5, 12]), backend="auto")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(dout)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in names
    assert not any("einsum" in n for n in names), names
    assert seg.runs  # sanity: two runs of different lengths


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("packed", [False, True])
def test_ring_style_backward_against_merged_out_and_lse(backend, packed):
    """Blocks merged with the lse formula equal one attention; each block's backward against the
    merged (out, lse) is that block's exact share: dk/dv of its keys, a summand of dq."""
    b, s, h, hk, blk = 1, 12, 4, 2, 4
    q, k, v, dout = _inputs(b, s, s, h, hk, seed=2)
    seg = _segments([0, 5, 10]) if packed else None  # packed: tokens 10, 11 are padding
    ref_out, ref_lse, ref_grads = _grads(lambda *t: _reference(*t, seg), q.double(), k.double(), v.double(),
                                         dout.double())
    out = lse = None
    blocks = [(lo, lo + blk) for lo in range(0, s, blk)]
    for lo, hi in blocks:
        bseg = None if seg is None else seg.restrict(0, s, lo, hi)
        o, l = attention_forward(q, k[:, lo:hi], v[:, lo:hi], segments=bseg, backend=backend)
        out, lse = merge_attention(out, lse, o, l)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, **TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **TOL)
    dq = torch.zeros_like(q)
    for lo, hi in blocks:
        bseg = None if seg is None else seg.restrict(0, s, lo, hi)
        dq_b, dk_b, dv_b = attention_backward(dout, q, k[:, lo:hi], v[:, lo:hi], out.to(q.dtype), lse,
                                              segments=bseg, backend=backend)
        dq += dq_b
        torch.testing.assert_close(dk_b.double(), ref_grads[1][:, lo:hi], **TOL)
        torch.testing.assert_close(dv_b.double(), ref_grads[2][:, lo:hi], **TOL)
    torch.testing.assert_close(dq.double(), ref_grads[0], **TOL)


def test_empty_inputs_give_empty_results_and_grads():
    q, k, v = (torch.randn(0, 3, 2, 8, requires_grad=True) for _ in range(3))
    out, lse = segment_attention(q, k, v, backend="flash_cpu")
    assert out.shape == q.shape and lse.shape == (0, 2, 3)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


# --------------------------------------------------------------------------------------------
# plans cached on Segments


@pytest.mark.parametrize("cu, padded, runs", [
    ([0, 4, 8, 12], None, [(3, 0, 4, 4)]),                           # one covering run
    ([0, 4, 8, 11, 14, 15], None, [(2, 0, 4, 4), (2, 8, 3, 3), (1, 14, 1, 1)]),
    ([0, 3, 6], [0, 4, 8], [(2, 0, 4, 3)]),                          # padded slots: stride 4, length 3
    ([0, 2, 2, 4], None, [(2, 0, 2, 2)]),                            # the empty segment is skipped
])
def test_runs_group_equal_evenly_strided_segments(cu, padded, runs):
    seg = _segments(cu, None, padded, padded)
    assert [(r.n, r.q_start, r.q_stride, r.q_len) for r in seg.runs] == runs


def test_plans_are_built_once_per_segments_object():
    seg = _segments([0, 3, 7])
    assert seg.runs is seg.runs
    assert seg.restrict(0, 7, 0, 4) is seg.restrict(0, 7, 0, 4)
    assert seg.varlen("cpu") is seg.varlen(torch.device("cpu"))
    assert seg == _segments([0, 3, 7]) and hash(seg) == hash(_segments([0, 3, 7]))  # caches stay out of eq


def test_varlen_takes_slices_where_padding_can_join_the_kernel_call():
    """Padding between segments runs inside the varlen call (its own segment, or queries joining
    the segment before them), cleared after, so q/k are sliced, not gathered; shared keys or
    padding keys facing no padding queries keep the gather."""
    vl = CASES["padded_slots_varlen"][-1].varlen("cpu")
    assert vl.q_index is None and vl.k_index is None and (vl.q_range, vl.k_range) == ((0, 11), (0, 11))
    assert vl.cu_q.tolist() == [0, 3, 4, 8, 9, 11] and vl.q_pad.tolist() == vl.k_pad.tolist() == [3, 8]
    cross = CASES["cross_padded_gaps"][-1].varlen("cpu")
    assert cross.q_index is None and cross.k_index is None
    assert cross.q_pad.tolist() == [3] and cross.k_pad.tolist() == [2]
    text = CASES["cross_layouts"][-1].varlen("cpu")  # packed text keys: the query gap joins segment 0
    assert text.q_index is None and text.cu_q.tolist() == [0, 3, 6] and text.cu_k.tolist() == [0, 4, 6]
    assert text.q_pad.tolist() == [2] and text.k_pad is None
    for case in ("key_gap_only", "shared_keys"):
        vl = CASES[case][-1].varlen("cpu")
        assert vl.q_index is not None or vl.k_index is not None
        assert vl.q_pad is None and vl.k_pad is None


def test_padded_segments_skip_inner_padding():
    """TE-style (cu_seqlens, cu_seqlens_padded): padding inside a sample's slot is never attended."""
    real, padded = [0, 3, 5], [0, 4, 8]
    seg = Segments.from_cu_seqlens(real, real, padded, padded)
    assert seg.nonempty() == [(0, 3, 0, 3), (4, 6, 4, 6)]


# --------------------------------------------------------------------------------------------
# varlen glue (CUDA-only kernels) with emulated ops


def _math_varlen_forward(q, k, v, vl, scale):
    """A varlen kernel in the flash layout (lse [h, t_q]) built from the math kernel, per segment."""
    cu_q, cu_k = vl.cu_q.tolist(), vl.cu_k.tolist()
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        o, l = ak.math_forward(q[None, cu_q[i]:cu_q[i + 1]], k[None, cu_k[i]:cu_k[i + 1]],
                               v[None, cu_k[i]:cu_k[i + 1]], scale)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _math_varlen_backward(dout, q, k, v, out, lse, vl, scale):
    cu_q, cu_k = vl.cu_q.tolist(), vl.cu_k.tolist()
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for i in range(len(cu_q) - 1):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        g = ak.math_backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], out[None, sq],
                             lse[None, :, sq], scale)
        for acc, part, sl in zip(grads, g, (sq, sk, sk)):
            acc[sl] = part[0]
    return tuple(grads)


class _EmulatedEfficientOps:
    """CPU stand-ins for aten's memory-efficient varlen ops, with their per-segment lse layout."""

    @staticmethod
    def forward(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout, mask_type, compute_lse, scale):
        vl = _FakeVarlen(cu_q, cu_k, max_q, max_k)
        out, lse = _math_varlen_forward(q[0], k[0], v[0], vl, scale)
        stats = torch.full((len(vl.cu_q) - 1, q.shape[2], ak._lse_rows(max_q)), float("nan"))
        for i, (a, e) in enumerate(zip(vl.cu_q[:-1].tolist(), vl.cu_q[1:].tolist())):
            stats[i, :, :e - a] = lse[:, a:e]
        return out[None], stats, None, None, max_q, max_k

    @staticmethod
    def backward(dout, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, stats, dropout, seed, offset, mask_type,
                 bias_grad, scale):
        vl = _FakeVarlen(cu_q, cu_k, max_q, max_k)
        cq = vl.cu_q.tolist()
        lse = torch.cat([stats[i, :, :cq[i + 1] - cq[i]] for i in range(len(cq) - 1)], dim=1)
        grads = _math_varlen_backward(dout[0], q[0], k[0], v[0], out[0], lse, vl, scale)
        return tuple(g[None] for g in grads) + (None,)


class _FakeVarlen:
    def __init__(self, cu_q, cu_k, max_q, max_k):
        self.cu_q, self.cu_k, self.max_q, self.max_k = cu_q, cu_k, max_q, max_k


EMULATED = {
    "flash_layout": Kernel(ak.math_forward, ak.math_backward, gqa=True, varlen_forward=_math_varlen_forward,
                           varlen_backward=_math_varlen_backward),
    "efficient_layout": Kernel(ak.math_forward, ak.math_backward, gqa=False,
                               varlen_forward=ak._efficient_varlen_forward,
                               varlen_backward=ak._efficient_varlen_backward),
}


@pytest.mark.parametrize("kernel", list(EMULATED))
@pytest.mark.parametrize("case", ["runs_mixed_tail_pad", "padded_slots_one_strided_run", "cross_layouts",
                                  "empty_segment", "shared_keys", "padded_slots_varlen", "cross_padded_gaps",
                                  "key_gap_only"])
def test_varlen_path_with_emulated_kernels(monkeypatch, kernel, case):
    """Gather/scatter of real tokens, GQA repeat/sum and lse layouts of the varlen GPU path."""
    calls = []
    emulated = EMULATED[kernel]
    monkeypatch.setitem(KERNELS, "math64", Kernel(
        emulated.forward, emulated.backward, emulated.gqa,
        varlen_forward=lambda *a: calls.append("fwd") or emulated.varlen_forward(*a),
        varlen_backward=lambda *a: calls.append("bwd") or emulated.varlen_backward(*a)))
    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_forward", _EmulatedEfficientOps.forward)
    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_backward", _EmulatedEfficientOps.backward)
    b, s_q, s_kv, h, hk, seg = CASES[case]
    q, k, v, dout = _inputs(b, s_q, s_kv, h, hk, seed=3)
    out, lse, grads = _grads(lambda *t: segment_attention(*t, segments=seg, backend="math64"), q, k, v, dout)
    ref_out, ref_lse, ref_grads = _grads(lambda *t: _reference(*t, seg), q.double(), k.double(), v.double(),
                                         dout.double())
    torch.testing.assert_close(out.double(), ref_out, **TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **TOL)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), ref, **TOL)
    assert calls == (["fwd", "bwd"] if len(seg.runs) > 1 else [])  # one run: a batched dense call


@pytest.mark.parametrize("name, dtype", [("sdpa_flash", torch.bfloat16), ("sdpa_cudnn", torch.bfloat16),
                                         ("sdpa_efficient", torch.float32)])
def test_cuda_kernel_calls_match_the_aten_schemas(name, dtype):
    """The CUDA kernels' aten calls, run on the meta device: argument lists and lse layouts.
    (aten's meta function for ``_efficient_attention_backward`` disagrees with its own schema,
    so that one call is left to the GPU tests.)"""
    kernel = KERNELS[name]
    q = torch.empty(2, 37, 4, 64, dtype=dtype, device="meta")
    k = torch.empty(2, 41, 4, 64, dtype=dtype, device="meta")
    out, lse = kernel.forward(q, k, k, 0.1)
    assert out.shape == q.shape and lse.shape == (2, 4, 37) and lse.dtype == torch.float32
    if name != "sdpa_efficient":
        assert [g.shape for g in kernel.backward(out, q, k, k, out, lse, 0.1)] == [q.shape, k.shape, k.shape]
    if kernel.varlen_forward is not None:
        vl = _segments([0, 10, 25, 37], [0, 12, 30, 41]).varlen("meta")
        qp, kp = q[0, :37], k[0, :41]
        out, lse = kernel.varlen_forward(qp, kp, kp, vl, 0.1)
        assert out.shape == qp.shape and lse.shape == (4, 37)
        if name != "sdpa_efficient":
            grads = kernel.varlen_backward(out, qp, kp, kp, out, lse, vl, 0.1)
            assert [g.shape for g in grads] == [qp.shape, kp.shape, kp.shape]


# --------------------------------------------------------------------------------------------
# selection and errors


def test_auto_picks_cudnn_for_dense_half_attention_on_hopper_and_flash_for_packed():
    """The CUDA choice as a pure function (no GPU here): cuDNN where it is the fastest dense
    kernel (head dim <= 128), flash varlen for packed calls, flash-attn/torch flash elsewhere."""
    from dit_mcore.kernels.attention_kernels import choose
    hopper = dict(cuda=True, dtype=torch.bfloat16, cudnn_fastest=True)
    assert choose("auto", head_dim=72, dense=True, **hopper) == "sdpa_cudnn"
    assert choose("sdpa", head_dim=128, dense=True, **hopper) == "sdpa_cudnn"
    assert choose("auto", head_dim=72, dense=False, **hopper) == "sdpa_flash"
    assert choose("auto", head_dim=72, dense=False, have_flash_attn=True, **hopper) == "flash_attn"
    assert choose("sdpa", head_dim=72, dense=False, have_flash_attn=True, **hopper) == "sdpa_flash"
    assert choose("auto", head_dim=256, dense=True, **hopper) == "sdpa_flash"  # beyond cuDNN's 128
    assert choose("auto", head_dim=64, dense=True, gqa=True, **hopper) == "sdpa_flash"  # kv heads as they are
    ampere = dict(cuda=True, dtype=torch.bfloat16, cudnn_fastest=False, dense=True)
    assert choose("auto", head_dim=72, **ampere) == "sdpa_flash"
    assert choose("auto", head_dim=72, have_flash_attn=True, **ampere) == "flash_attn"
    fp32 = dict(cuda=True, dtype=torch.float32, cudnn_fastest=True, dense=True)
    assert choose("auto", head_dim=64, **fp32) == choose("sdpa", head_dim=64, **fp32) == "sdpa_efficient"
    assert choose("auto", head_dim=64, cuda=False, dtype=torch.bfloat16, dense=True) == "flash_cpu"
    assert choose("sdpa_flash", head_dim=64, dense=True, **hopper) == "sdpa_flash"  # a named kernel is itself


def test_auto_and_sdpa_pick_the_cpu_flash_kernel_and_log_once(caplog):
    q = torch.randn(1, 4, 2, 8)
    assert resolve_backend("auto", q) == resolve_backend("sdpa", q) == "flash_cpu"
    with caplog.at_level(logging.INFO, logger="kernels.local_attention"):
        local_attention(q, q, q, backend="auto")
        local_attention(q, q, q, backend="auto")
    lines = [r.getMessage() for r in caplog.records if "backend='auto'" in r.getMessage()]
    # lru_cache may have logged it in an earlier test already; never more than once
    assert len(lines) <= 1 and all("flash_cpu" in m for m in lines)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="nope"), "backend='nope' is unknown"),
    (dict(backend="flash_attn"), "needs CUDA"),
    (dict(backend="sdpa_efficient"), "needs CUDA"),
    (dict(cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)), "batch size 1"),
    (dict(cu_seqlens_q=torch.tensor([0, 9], dtype=torch.int32)), "cu_seqlens reach token 9"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 1], dtype=torch.int32)), "non-decreasing"),
])
def test_bad_inputs_raise(kwargs, match):
    b = 2 if "cu_seqlens_q" in kwargs and kwargs["cu_seqlens_q"][-1] == 2 else 1
    q = torch.randn(b, 4, 2, 4)
    with pytest.raises(ValueError, match=match):
        local_attention(q, q, q, **kwargs)


def test_gqa_heads_must_divide():
    with pytest.raises(ValueError, match="multiple of kv heads"):
        local_attention(torch.randn(1, 4, 3, 4), torch.randn(1, 4, 2, 4), torch.randn(1, 4, 2, 4))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, _ = _inputs(1, 5, 5, 2, 2, d=16)
    torch.testing.assert_close(local_attention(q, k, v), local_attention(q, k, v, softmax_scale=1 / math.sqrt(16)))
