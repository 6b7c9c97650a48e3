"""Local attention backends (dense, packed, GQA, padding, lse gradients) against float64 math."""
from __future__ import annotations

import logging

import pytest
import torch

from kernels import Segments, attention_backward, attention_forward, local_attention
from kernels.ring import merge_attention

CPU_BACKENDS = ["math64", "flash_cpu", "sdpa", "flex"]
SLOW_ON_CPU = {"flex"}  # eager FlexAttention on CPU is slow: one (packed) case is enough


def _reference(q, k, v, cu):
    """float64 attention with an explicit block-diagonal mask; rows without keys -> out 0, lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    b, s, h, d = q.shape
    k, v = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
    if cu is not None:
        ids = torch.full((s,), -1)
        for i in range(len(cu) - 1):
            ids[cu[i]:cu[i + 1]] = i
        mask = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _loss(out, lse, w_out, w_lse):
    return (out * w_out).sum() + torch.where(torch.isfinite(lse), lse * w_lse, torch.zeros_like(lse)).sum()


CASES = {
    "dense_gqa": dict(b=2, s=11, h=4, hk=2, cu=None),
    "packed_tail_pad": dict(b=1, s=14, h=4, hk=1, cu=[0, 3, 7, 12]),
    "packed_empty_segment": dict(b=1, s=9, h=2, hk=2, cu=[0, 4, 4, 9]),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_float64(backend, case):
    if backend in SLOW_ON_CPU and case != "packed_tail_pad":
        pytest.skip("covered by the packed_tail_pad case")
    c = CASES[case]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(c["b"], c["s"], c["h"], 8, generator=g, requires_grad=True)
    k, v = (torch.randn(c["b"], c["s"], c["hk"], 8, generator=g, requires_grad=True) for _ in range(2))
    w_out, w_lse = torch.randn(q.shape, generator=g), torch.randn(c["b"], c["h"], c["s"], generator=g)
    cu = None if c["cu"] is None else torch.tensor(c["cu"], dtype=torch.int32)
    out, lse = local_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, backend=backend, return_lse=True)
    _loss(out, lse, w_out, w_lse).backward()

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _reference(q64, k64, v64, c["cu"])
    _loss(ref_out, ref_lse, w_out.double(), w_lse.double()).backward()
    tol = dict(rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), ref, **tol)
    if c["cu"] is not None:  # padding past cu[-1]: out 0, lse -inf, gradients exactly 0
        tail = slice(c["cu"][-1], None)
        assert torch.isneginf(lse[:, :, tail]).all() and not out[:, tail].any()
        assert not q.grad[:, tail].any() and not k.grad[:, tail].any() and not v.grad[:, tail].any()


def test_padded_segments_skip_inner_padding():
    """TE-style (cu_seqlens, cu_seqlens_padded): padding inside a sample's slot is never attended."""
    real, padded = [0, 3, 5], [0, 4, 8]
    seg = Segments.from_cu_seqlens(real, real, padded, padded)
    assert seg.nonempty() == [(0, 3, 0, 3), (4, 6, 4, 6)]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g) for _ in range(3))
    out, lse = attention_forward(q, k, v, segments=seg, backend="flash_cpu")
    ref0, _ = _reference(q[:, 0:3], k[:, 0:3], v[:, 0:3], None)
    ref1, _ = _reference(q[:, 4:6], k[:, 4:6], v[:, 4:6], None)
    torch.testing.assert_close(out[:, 0:3].double(), ref0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[:, 4:6].double(), ref1, rtol=1e-5, atol=1e-6)
    assert not out[:, [3, 6, 7]].any() and torch.isneginf(lse[:, :, [3, 6, 7]]).all()


def test_merge_of_blocks_equals_full_attention_and_handles_empty_rows():
    """Merging per-key-block (out, lse) equals one attention, also for rows empty in some blocks;
    the backward against the merged (out, lse) summed over blocks equals the full backward."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 12, 2, 4, generator=g) for _ in range(3))
    dout = torch.randn(1, 12, 2, 4, generator=g)
    seg = Segments.from_cu_seqlens([0, 5, 10])  # tokens 10, 11 are padding
    full_out, full_lse = attention_forward(q, k, v, segments=seg, backend="math64")
    out = lse = None
    for lo in range(0, 12, 4):
        blk = seg.restrict(0, 12, lo, lo + 4)
        o, l = attention_forward(q, k[:, lo:lo + 4], v[:, lo:lo + 4], segments=blk, backend="flash_cpu")
        out, lse = merge_attention(out, lse, o, l)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, full_out.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-6)
    dq_full, dk_full, dv_full = attention_backward(dout, q, k, v, full_out, full_lse, segments=seg)
    dq = torch.zeros_like(dq_full)
    for lo in range(0, 12, 4):
        dq_b, dk_b, dv_b = attention_backward(dout, q, k[:, lo:lo + 4], v[:, lo:lo + 4], out, lse,
                                              segments=seg.restrict(0, 12, lo, lo + 4))
        dq += dq_b
        torch.testing.assert_close(dk_b, dk_full[:, lo:lo + 4], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dv_b, dv_full[:, lo:lo + 4], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dq, dq_full, rtol=1e-5, atol=1e-6)


def test_auto_backend_is_logged_once(caplog):
    q = torch.randn(1, 4, 2, 4)
    with caplog.at_level(logging.INFO, logger="kernels.local_attention"):
        local_attention(q, q, q, backend="auto")
        local_attention(q, q, q, backend="auto")
    lines = [r.getMessage() for r in caplog.records if "backend='auto'" in r.getMessage()]
    # lru_cache may have logged it in an earlier test already; never more than once
    assert len(lines) <= 1 and all("flash_cpu" in m for m in lines)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="nope"), "backend='nope' is unknown"),
    (dict(backend="flash_attn"), "needs CUDA"),
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
