"""GPU checks: run only where CUDA is present (skipped on the CPU CI, which has none)."""

import pytest
import torch

from attention_reference import reference_attention

from dit_mcore.kernels import Segments, attention_backward, attention_forward, segment_attention
from dit_mcore.kernels.attention_kernels import HAVE_FLASH_ATTN, cudnn_is_fastest, resolve_backend
from dit_mcore.kernels.ring import merge_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# ---- attention kernels: forward and backward against float64 -------------------------------

HALF_BACKENDS = ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn", "auto"]
# (batch, seq, heads, kv heads, cu_seqlens or None)
LAYOUTS = {
    "dense_gqa": (2, 128, 8, 2, None),
    "packed_mixed_gqa": (1, 208, 8, 2, [0, 40, 90, 150, 190]),   # varlen (cuDNN: runs), tail padding
    "packed_images": (1, 192, 4, 4, [0, 64, 128, 192]),           # one run: a batched dense call
    "packed_long": (1, 1100, 4, 4, [0, 300, 700, 1000]),           # varlen, segments of 300-400 rows
    # padded slots: the padding between segments runs inside the varlen call, then is cleared
    "packed_gaps": (1, 1100, 4, 4, ([0, 300, 700, 1000], [0, 350, 800, 1100])),
}
# max |error| / max |reference| per output; bf16 as TransformerEngine's CP tests (2.5e-2)
REL_TOL = {torch.bfloat16: 2.5e-2, torch.float32: 1e-3}


def _skip_missing(backend):
    if backend == "flash_attn" and not HAVE_FLASH_ATTN:
        pytest.skip("flash-attn is not installed")


def _reference(q, k, v, segments):
    """float64 attention on the CPU (leaves for the caller's backward), output and lse."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(q, k, v, segments)
    return (q, k, v), out, lse


def _inputs(layout, dtype, seed=0):
    b, s, h, hk, cu = LAYOUTS[layout]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, h, 64, device="cuda", generator=g, dtype=dtype)
    k, v = (torch.randn(b, s, hk, 64, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    dout = torch.randn(b, s, h, 64, device="cuda", generator=g, dtype=dtype)
    if isinstance(cu, tuple):  # (real, padded) cumulative lengths
        return q, k, v, dout, Segments.from_cu_seqlens(cu[0], cu[0], cu[1], cu[1])
    return q, k, v, dout, None if cu is None else Segments.from_cu_seqlens(cu)


def _assert_rel(got, ref, tol, what):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got)), f"{what}: non-finite entries differ"
    err = (got[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    scale = ref[finite].abs().max().item() if finite.any() else 1.0
    assert err <= tol * max(scale, 1e-6), f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def _check_against_float64(backend, dtype, layout):
    q, k, v, dout, seg = _inputs(layout, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = segment_attention(*leaves, segments=seg, backend=backend)
    out.backward(dout)
    ref_leaves, ref_out, ref_lse = _reference(q, k, v, seg)
    ref_out.backward(dout.double().cpu())
    tol = REL_TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    _assert_rel(out, ref_out, tol, "out")
    _assert_rel(lse, ref_lse, tol, "lse")
    for name, got, ref in zip("qkv", leaves, ref_leaves):
        assert got.grad.dtype == dtype
        _assert_rel(got.grad, ref.grad, tol, f"d{name}")
    if seg is not None:  # padding (between segments and at the tail): out 0, lse -inf, gradients exactly 0
        pad = torch.ones(q.shape[1], dtype=torch.bool, device=q.device)
        for a, e, _, _ in seg.nonempty():
            pad[a:e] = False
        assert not out[:, pad].any() and torch.isneginf(lse[:, :, pad]).all()
        assert not any(t.grad[:, pad].any() for t in leaves)


@pytest.mark.parametrize("backend", HALF_BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_attention_matches_float64_bf16(backend, layout):
    _skip_missing(backend)
    _check_against_float64(backend, torch.bfloat16, layout)


@pytest.mark.parametrize("backend", ["sdpa_efficient", "auto"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_attention_matches_float64_fp32(backend, layout):
    _check_against_float64(backend, torch.float32, layout)


@pytest.mark.parametrize("backend", HALF_BACKENDS)
@pytest.mark.parametrize("layout", ["dense_gqa", "packed_mixed_gqa", "packed_long", "packed_gaps"])
def test_gpu_ring_style_backward_against_merged_out_and_lse(backend, layout):
    """Per-key-block forward merged by lse, then each block's backward against the merged
    (out, lse): the blocks' dk/dv and summed dq equal the full attention's gradients."""
    _skip_missing(backend)
    q, k, v, dout, seg = _inputs(layout, torch.bfloat16, seed=1)
    s, nblocks = q.shape[1], 4
    bounds = [(i * s // nblocks, (i + 1) * s // nblocks) for i in range(nblocks)]
    out = lse = None
    for lo, hi in bounds:
        bseg = None if seg is None else seg.restrict(0, s, lo, hi)
        o, l = attention_forward(q, k[:, lo:hi], v[:, lo:hi], segments=bseg, backend=backend)
        out, lse = merge_attention(out, lse, o, l)
    ref_leaves, ref_out, ref_lse = _reference(q, k, v, seg)
    ref_out.backward(dout.double().cpu())
    tol = REL_TOL[torch.bfloat16]
    _assert_rel(out, ref_out, tol, "merged out")
    _assert_rel(lse, ref_lse, tol, "merged lse")
    dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    for lo, hi in bounds:
        bseg = None if seg is None else seg.restrict(0, s, lo, hi)
        dq_b, dk_b, dv_b = attention_backward(dout, q, k[:, lo:hi], v[:, lo:hi], out.to(q.dtype), lse,
                                              segments=bseg, backend=backend)
        dq += dq_b
        _assert_rel(dk_b, ref_leaves[1].grad[:, lo:hi], tol, f"dk block {lo}:{hi}")
        _assert_rel(dv_b, ref_leaves[2].grad[:, lo:hi], tol, f"dv block {lo}:{hi}")
    _assert_rel(dq, ref_leaves[0].grad, tol, "dq")


def test_gpu_auto_picks_a_fused_kernel_per_dtype():
    half = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    packed = Segments.from_cu_seqlens([0, 3, 8])
    flash = "flash_attn" if HAVE_FLASH_ATTN else "sdpa_flash"
    assert resolve_backend("auto", half) == ("sdpa_cudnn" if cudnn_is_fastest() else flash)
    assert resolve_backend("auto", half, packed) == flash
    assert resolve_backend("sdpa", half, packed) == "sdpa_flash"
    assert resolve_backend("auto", half.float()) == "sdpa_efficient"
