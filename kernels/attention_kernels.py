"""Fused attention kernels behind one interface: forward returns the log-sum-exp, backward takes it.

Every backend is a :class:`Kernel` of plain functions on ``[b, s, h, d]`` tensors (any strides
with a unit last stride): ``forward(q, k, v, scale) -> (out, lse fp32 [b, h, s_q])`` and
``backward(dout, q, k, v, out, lse, scale) -> (dq, dk, dv)`` in the input dtypes, plus, for the
GPU kernels that have one, a varlen pair on packed ``[tokens, h, d]`` tensors described by a
:class:`kernels.segments.Varlen`.

The backward recomputes ``p = exp(s - lse)`` and ``delta = rowsum(dout * out)`` from the ``out``
and ``lse`` it is given. Handing it the *merged* ``(out, lse)`` of several key blocks (a ring)
therefore yields this block's exact share of the gradient, which is what the context-parallel
ops rely on. A gradient flowing into lse itself is not something the fused kernels take; the
float math backward (:func:`math_backward`) handles it, and ``math64`` (float64) is the
reference the tests compare against.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger("kernels.local_attention")

BACKENDS = ("auto", "sdpa", "flash_cpu", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn", "math64")
"""``sdpa`` is torch's best fused SDPA kernel for the device, dtype and call (``flash_cpu`` on CPU;
on CUDA in half precision ``sdpa_cudnn`` for dense calls without GQA on Hopper and Blackwell, else ``sdpa_flash``;
``sdpa_efficient`` otherwise); ``auto`` also takes flash-attn where installed (see :func:`choose`)."""

_CUDA_ONLY = {"sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn"}
_HALF_ONLY = {"sdpa_flash", "sdpa_cudnn", "flash_attn"}
_HALF = (torch.float16, torch.bfloat16)

# Cap on score-matrix elements materialised at once by the math paths (fp32: 256 MiB).
_MAX_SCORE_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Kernel:
    """One backend's forward/backward (see the module docstring for the contract)."""

    forward: Callable
    backward: Callable
    gqa: bool
    """True if the kernel takes fewer kv heads than query heads itself (else kv are repeated)."""
    varlen_forward: Optional[Callable] = None
    """``(q [t_q,h,d], k, v, varlen, scale) -> (out [t_q,h,d], lse fp32 [h, t_q])``."""
    varlen_backward: Optional[Callable] = None
    """``(dout, q, k, v, out, lse [h, t_q], varlen, scale) -> (dq, dk, dv)``."""


# --------------------------------------------------------------------------------------------
# math (reference, and the backward for a gradient on lse)


def math_forward(q, k, v, scale, dtype=torch.float64):
    """Exact softmax attention computed in ``dtype``, chunked over kv heads to bound memory."""
    b, s_q, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    qg = q.to(dtype).reshape(b, s_q, hk, g, d)
    kd, vd = k.to(dtype), v.to(dtype)
    out = torch.empty(b, s_q, hk, g, d, dtype=dtype, device=q.device)
    lse = torch.empty(b, hk, g, s_q, dtype=dtype, device=q.device)
    for sl in _head_chunks(b * g * s_q * k.shape[1], hk):
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg[:, :, sl], kd[:, :, sl]) * scale
        lse[:, sl] = torch.logsumexp(s, dim=-1)
        out[:, :, sl] = torch.einsum("bhgqk,bkhd->bqhgd", torch.exp(s - lse[:, sl].unsqueeze(-1)), vd[:, :, sl])
    return out.reshape(b, s_q, h, d).to(q.dtype), lse.reshape(b, h, s_q).float()


def math_backward(dout, q, k, v, out, lse, scale, dlse=None, dtype=None):
    """Gradients from the saved forward, computed in ``dtype`` (default: fp32, fp64 for fp64).

    ``dlse`` ``[b, h, s_q]`` is a gradient on lse itself: ``d lse / d s = p``, so it enters as
    ``ds = p * (dp - (rowsum(dout * out) - dlse))``.
    """
    dtype = dtype or torch.promote_types(q.dtype, torch.float32)
    b, s_q, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    qg = q.to(dtype).reshape(b, s_q, hk, g, d)
    dog = dout.to(dtype).reshape(b, s_q, hk, g, d)
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1).transpose(1, 2)          # [b, h, s_q]
    if dlse is not None:
        delta = delta - dlse.to(dtype)
    lse_g, delta_g = (t.reshape(b, hk, g, s_q) for t in (lse.to(dtype), delta))
    kd, vd = k.to(dtype), v.to(dtype)
    dq = torch.empty(b, s_q, hk, g, d, dtype=dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=dtype, device=q.device)
    for sl in _head_chunks(b * g * s_q * k.shape[1], hk):
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg[:, :, sl], kd[:, :, sl]) * scale
        p = torch.exp(s - lse_g[:, sl].unsqueeze(-1))
        dp = torch.einsum("bqhgd,bkhd->bhgqk", dog[:, :, sl], vd[:, :, sl])
        ds = p * (dp - delta_g[:, sl].unsqueeze(-1))
        dq[:, :, sl] = torch.einsum("bhgqk,bkhd->bqhgd", ds, kd[:, :, sl]) * scale
        dk[:, :, sl] = torch.einsum("bhgqk,bqhgd->bkhd", ds, qg[:, :, sl]) * scale
        dv[:, :, sl] = torch.einsum("bhgqk,bqhgd->bkhd", p, dog[:, :, sl])
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _head_chunks(elements_per_head, heads):
    step = max(1, min(heads, _MAX_SCORE_ELEMENTS // max(1, elements_per_head)))
    return [slice(lo, min(lo + step, heads)) for lo in range(0, heads, step)]


MATH64 = Kernel(math_forward, functools.partial(math_backward, dtype=torch.float64), gqa=True)
_MATH = Kernel(math_forward, math_backward, gqa=True)


def lse_grad_kernel(backend: str) -> Kernel:
    """The kernel whose backward accepts a gradient on lse: float math (float64 for ``math64``)."""
    return MATH64 if backend == "math64" else _MATH


# --------------------------------------------------------------------------------------------
# CPU: torch's flash kernel


def _bhsd(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def _cpu_flash_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_bhsd(q, k, v), scale=scale)
    return out.transpose(1, 2), lse.float()


def _cpu_flash_backward(dout, q, k, v, out, lse, scale):
    stats = lse.to(torch.promote_types(q.dtype, torch.float32)).contiguous()  # the kernel's lse dtype
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_bhsd(dout, q, k, v, out), stats, 0.0, False, scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


# --------------------------------------------------------------------------------------------
# CUDA: torch's flash, memory-efficient and cuDNN kernels (aten ops, no autograd)


def _no_rng(q):
    """Placeholder rng tensors: dropout is 0, so the kernels never read them."""
    return torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)


def _checked(lse, shape, kernel):
    if tuple(lse.shape) != tuple(shape):
        raise RuntimeError(f"{kernel} returned lse of shape {tuple(lse.shape)}, expected {tuple(shape)}; "
                           f"this torch/flash-attn version uses another lse layout (use backend='sdpa_efficient')")
    return lse


def _torch_flash_forward(q, k, v, scale):
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, False,
                                                       False, scale=scale)[:2]
    return out, lse


def _torch_flash_backward(dout, q, k, v, out, lse, scale):
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse.contiguous(), None, None, q.shape[1],
                                                    k.shape[1], 0.0, False, *_no_rng(q), scale=scale)


def _torch_flash_varlen_forward(q, k, v, vl, scale):
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, 0.0, False,
                                                       False, scale=scale)[:2]
    return out, _checked(lse, (q.shape[1], q.shape[0]), "aten._flash_attention_forward (varlen)")


def _torch_flash_varlen_backward(dout, q, k, v, out, lse, vl, scale):
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse.contiguous(), vl.cu_q, vl.cu_k,
                                                    vl.max_q, vl.max_k, 0.0, False, *_no_rng(q), scale=scale)


def _lse_rows(max_q):
    """The memory-efficient kernel stores lse rows padded to a multiple of 32 queries."""
    return -(-max_q // 32) * 32


def _efficient_forward(q, k, v, scale):
    out, lse = torch.ops.aten._efficient_attention_forward(q, k, v, None, None, None, None, None, 0.0, 0, True,
                                                           scale=scale)[:2]
    return out, lse[:, :, :q.shape[1]]


def _efficient_backward(dout, q, k, v, out, lse, scale):
    stats = F.pad(lse, (0, _lse_rows(q.shape[1]) - q.shape[1]))
    return torch.ops.aten._efficient_attention_backward(
        dout, q, k, v, None, out.contiguous(), None, None, q.shape[1], k.shape[1], stats, 0.0, *_no_rng(q), 0,
        False, scale=scale)[:3]


def _efficient_varlen_forward(q, k, v, vl, scale):
    out, lse = torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, vl.cu_q, vl.cu_k,
                                                           vl.max_q, vl.max_k, 0.0, 0, True, scale=scale)[:2]
    return out[0], lse[vl.q_segment, :, vl.q_position].t()  # per-segment [n, h, rows] -> [h, t_q]


def _efficient_varlen_backward(dout, q, k, v, out, lse, vl, scale):
    stats = lse.new_zeros(vl.cu_q.shape[0] - 1, q.shape[1], _lse_rows(vl.max_q))
    stats[vl.q_segment, :, vl.q_position] = lse.t()
    grads = torch.ops.aten._efficient_attention_backward(
        dout[None], q[None], k[None], v[None], None, out[None].contiguous(), vl.cu_q, vl.cu_k, vl.max_q, vl.max_k,
        stats, 0.0, *_no_rng(q), 0, False, scale=scale)
    return tuple(g[0] for g in grads[:3])


def _cudnn_forward(q, k, v, scale):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(*_bhsd(q.contiguous(), k.contiguous(), v.contiguous()),
                                                           None, True, 0.0, False, False, scale=scale)
    return r[0].transpose(1, 2), r[1].reshape(q.shape[0], q.shape[2], q.shape[1])  # lse [b, h, s, 1]


def _cudnn_backward(dout, q, k, v, out, lse, scale):
    # cuDNN wants every operand in the layout its forward produced (BSHD memory, BHSD view).
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        *_bhsd(*(t.contiguous() for t in (dout, q, k, v, out))), lse.contiguous().unsqueeze(-1), seed, seed, None,
        None, None, q.shape[1], k.shape[1], 0.0, False, scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


# --------------------------------------------------------------------------------------------
# CUDA: the flash-attn package


@functools.lru_cache(maxsize=None)
def _flash_attn_window_args() -> tuple:
    """flash-attn 2.7 split ``window_size`` into left/right arguments of its backward."""
    import flash_attn

    version = tuple(int(x) for x in flash_attn.__version__.split(".")[:2])
    if version < (2, 6):
        raise RuntimeError(f"backend='flash_attn' needs flash-attn >= 2.6, found {flash_attn.__version__}")
    return (-1, -1) if version >= (2, 7) else ((-1, -1),)


def _fa_backward_args(dout, q, k, v, out, lse):
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    return grads, (dout, q, k, v, out, lse.contiguous(), *grads)


def _fa_tail(scale):
    # dropout, scale, causal, window, softcap, alibi, deterministic, rng_state
    return (0.0, scale, False, *_flash_attn_window_args(), 0.0, None, False, None)


def _flash_attn_forward(q, k, v, scale):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, scale):
    from flash_attn.flash_attn_interface import _flash_attn_backward

    grads, args = _fa_backward_args(dout, q, k, v, out, lse)
    _flash_attn_backward(*args, *_fa_tail(scale))
    return tuple(grads)


def _flash_attn_varlen_forward(q, k, v, vl, scale):
    from flash_attn import flash_attn_varlen_func

    out, lse, _ = flash_attn_varlen_func(q, k, v, vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, softmax_scale=scale,
                                         return_attn_probs=True)
    return out, _checked(lse, (q.shape[1], q.shape[0]), "flash_attn_varlen_func")


def _flash_attn_varlen_backward(dout, q, k, v, out, lse, vl, scale):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    grads, args = _fa_backward_args(dout, q, k, v, out, lse)
    _flash_attn_varlen_backward(*args, vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, *_fa_tail(scale))
    return tuple(grads)


KERNELS = {
    "math64": MATH64,
    "flash_cpu": Kernel(_cpu_flash_forward, _cpu_flash_backward, gqa=True),
    "sdpa_flash": Kernel(_torch_flash_forward, _torch_flash_backward, gqa=True,
                         varlen_forward=_torch_flash_varlen_forward, varlen_backward=_torch_flash_varlen_backward),
    "sdpa_efficient": Kernel(_efficient_forward, _efficient_backward, gqa=False,
                             varlen_forward=_efficient_varlen_forward, varlen_backward=_efficient_varlen_backward),
    "sdpa_cudnn": Kernel(_cudnn_forward, _cudnn_backward, gqa=False),
    "flash_attn": Kernel(_flash_attn_forward, _flash_attn_backward, gqa=True,
                         varlen_forward=_flash_attn_varlen_forward, varlen_backward=_flash_attn_varlen_backward),
}


# --------------------------------------------------------------------------------------------
# selection


@functools.lru_cache(maxsize=None)
def _log_choice(requested: str, chosen: str, device: str) -> None:
    logger.info("kernels.local_attention: backend=%r -> %s on %s", requested, chosen, device)


HAVE_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None  # once: find_spec breaks compiled graphs


@torch.compiler.assume_constant_result
def cudnn_is_fastest() -> bool:
    """Whether cuDNN's fused attention is the fastest dense kernel here: Hopper (sm90) or Blackwell
    (sm100) with cuDNN 9, where torch's own SDPA dispatch prefers it too, unless it was switched off
    (``torch.backends.cuda.enable_cudnn_sdp(False)``). On an H200, DiT-XL/2's attention (head dim
    72) took 19 ms per step with cuDNN against 36 ms with torch's flash kernel."""
    return torch.backends.cuda.cudnn_sdp_enabled() and _cudnn_generation()


@functools.lru_cache(maxsize=None)
def _cudnn_generation() -> bool:
    if not torch.cuda.is_available() or not torch.backends.cudnn.is_available():
        return False
    return (torch.backends.cudnn.version() or 0) >= 90000 and torch.cuda.get_device_capability()[0] in (9, 10)


def choose(backend: str, *, cuda: bool, dtype: torch.dtype, head_dim: int, dense: bool, gqa: bool = False,
           cudnn_fastest: bool = False, have_flash_attn: bool = False) -> str:
    """The kernel ``backend`` means for these inputs (``auto`` and ``sdpa`` are resolved; any
    other name is itself). ``dense``: one attention per batch row, no packed segments (cuDNN has
    no varlen form here, so packed data keeps the flash varlen kernels); ``gqa``: fewer kv heads
    than query heads (cuDNN would take them repeated, the flash kernels take them as they are)."""
    if backend not in ("auto", "sdpa"):
        return backend
    if not cuda:
        return "flash_cpu"
    flash_fits = dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256
    if dense and not gqa and cudnn_fastest and flash_fits and head_dim <= 128:
        return "sdpa_cudnn"
    if backend == "auto" and flash_fits and have_flash_attn:
        return "flash_attn"
    return "sdpa_flash" if flash_fits else "sdpa_efficient"


def resolve_backend(backend: str, q: torch.Tensor, segments=None, k: Optional[torch.Tensor] = None) -> str:
    """The backend that runs for ``backend`` on ``q``'s device and dtype (validated, logged once).

    ``auto`` takes the fastest: the flash op on CPU; on CUDA, for dense calls (``segments`` None or
    one run, no GQA) cuDNN's kernel on Hopper and Blackwell, else flash-attn when installed and the input is
    half precision, else torch's flash kernel (half) or memory-efficient kernel (fp32). ``sdpa``
    is the same without flash-attn.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; choose one of {BACKENDS}")
    dense = segments is None or len(segments.runs) == 1
    gqa = k is not None and k.shape[-2] != q.shape[-2]
    chosen = choose(backend, cuda=q.is_cuda, dtype=q.dtype, head_dim=q.shape[-1], dense=dense, gqa=gqa,
                    cudnn_fastest=q.is_cuda and cudnn_is_fastest(), have_flash_attn=HAVE_FLASH_ATTN)
    if chosen in _CUDA_ONLY and not q.is_cuda:
        raise ValueError(f"backend={chosen!r} needs CUDA tensors; use backend='auto' or 'flash_cpu' on CPU")
    if chosen == "flash_cpu" and q.device.type != "cpu":
        raise ValueError(f"backend='flash_cpu' needs CPU tensors, got {q.device}; use backend='auto'")
    if chosen in _HALF_ONLY and q.dtype not in _HALF:
        raise ValueError(f"backend={chosen!r} needs float16/bfloat16 inputs, got {q.dtype}; use "
                         "backend='sdpa_efficient' (or 'auto') for other dtypes")
    if not torch.compiler.is_compiling():  # logging breaks a compiled graph; the eager first call logs
        _log_choice(backend, chosen, f"{q.device.type} {str(q.dtype).replace('torch.', '')}")
    return chosen


def softmax_scale_or_default(softmax_scale, q) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
