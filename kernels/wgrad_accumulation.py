"""A linear's weight gradient accumulated by its GEMM straight into megatron's ``main_grad``.

megatron DDP keeps every parameter's gradient in one buffer (``param.main_grad``; fp32 unless
``optim.main_grads_dtype=bf16``). Without apex (``fused_weight_gradient_mlp_cuda``, which megatron's
``gradient_accumulation_fusion`` requires), the weight-gradient GEMM writes a bf16 gradient and DDP's
backward hook then adds it into the buffer with one more kernel per parameter: 12 bytes per parameter
per micro-batch (13 ms of a MovieGen-3B step on an H200). :func:`accumulate_wgrad` lets the GEMM do the
add (cuBLAS with the fp32 buffer as its C and D, beta 1): 8 bytes per parameter, no second kernel, and
the products summed in fp32 without the bf16 rounding of a separate gradient -- what apex's
``wgrad_gemm_accum_fp32`` does.

It is a torch custom op that mutates ``main_grad``: ``torch.compile`` keeps it as one opaque call
and mutates the buffer in place, no copy. The kernel, by case:

- gradient and buffer of one dtype (fp32 training, or bf16 buffers): ``main_grad.addmm_``, one GEMM,
  any device;
- bf16/fp16 gradients into an fp32 buffer on a GPU whose torch ``addmm`` takes ``out_dtype`` with an
  fp32 input (probed once per device): the fused GEMM above;
- otherwise (the CPU, older torch): the product in the gradients' dtype, then an add into the
  buffer -- the bytes and rounding of megatron's hook, inside the compiled graph.
"""
from __future__ import annotations

import functools

import torch


@torch.library.custom_op("dit_mcore::accumulate_wgrad", mutates_args=("main_grad",))
def accumulate_wgrad(main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input`` over all leading (token) dims: the weight gradient of
    ``F.linear(input, weight)`` added into ``main_grad`` (``[out, in]``)."""
    g = grad_output.reshape(-1, grad_output.shape[-1])
    x = input.reshape(-1, input.shape[-1])
    if main_grad.dtype == g.dtype:
        main_grad.addmm_(g.t(), x)
    elif mixed_addmm_accumulates(main_grad.device, g.dtype, main_grad.dtype):
        torch.addmm(main_grad, g.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(g.t() @ x)


@accumulate_wgrad.register_fake
def _(main_grad, grad_output, input) -> None:
    return None


def gemm_accumulates(device: torch.device, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether :func:`accumulate_wgrad` adds ``dtype`` gradients into an ``out_dtype`` buffer inside the
    GEMM (one dtype: always; across dtypes: where :func:`mixed_addmm_accumulates`), rather than
    computing the product and adding it after."""
    return dtype == out_dtype or mixed_addmm_accumulates(device, dtype, out_dtype)


@functools.lru_cache(maxsize=None)
def mixed_addmm_accumulates(device: torch.device, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether this torch's ``addmm`` on ``device`` accumulates ``dtype`` matrices into an
    ``out_dtype`` tensor in place (``out_dtype=``, ``out=`` the input): a CUDA kernel since torch
    2.8, whose first versions refused an input of the output's dtype. Probed once, on tiny tensors,
    against the float64 product."""
    if device.type != "cuda":
        return False
    try:
        a = torch.arange(6, device=device, dtype=torch.float64).reshape(2, 3).to(dtype)
        b = torch.arange(12, device=device, dtype=torch.float64).reshape(3, 4).to(dtype)
        c = torch.ones(2, 4, device=device, dtype=out_dtype)
        expected = 1 + a.double() @ b.double()
        torch.addmm(c, a, b, out_dtype=out_dtype, out=c)
        return bool(torch.equal(c.double(), expected))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
