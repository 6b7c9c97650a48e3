"""The planner's step time against published multi-GPU runs it was not fitted to, and the device model under it:
the GPU's fused RMSNorm the trace runs in place of the CPU's decomposition, attention rates by sequence length.

The rows, with their sources, live in ``benchmarks/plan_published_rows.py`` (NeMo's DiT table, Megatron-Bridge's
Wan 2.1 14B); ``benchmarks/results/cpu_2026-12-01_plan_published_rows.md`` says how each model shape was chosen."""
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dit_mcore.plan import cli
from dit_mcore.plan.device_kernels import gpu_kernels, rms_norm
from dit_mcore.plan.gpus import FA3_PAPER_CUDNN_H100, GPUS
from dit_mcore.plan.op_costs import OpCosts
from megatron_env import single_process_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from plan_published_rows import GPU, ROWS  # noqa: E402  (the rows' one home, with their sources)


@pytest.fixture(scope="module")
def world():
    single_process_world()


@pytest.mark.parametrize("name, command, layout, published", ROWS, ids=[r[0] for r in ROWS])
def test_published_rows_within_20_percent(world, name, command, layout, published):
    """Predicted TFLOPS/GPU within 20% of each published row, the published layout fitting an H100-80GB; the
    row published as out of memory predicted out of memory."""
    planner = cli.planner_of(cli.parse_args([*command, *GPU]))
    e = cli.explained(planner, layout)
    if published is None:
        assert not e.fits, f"{name}: predicted to fit ({e.memory.total / 2**30:.1f} GiB)"
        return
    assert e.fits, f"{name}: predicted not to fit ({e.memory.total / 2**30:.1f} GiB)"
    assert e.tflops_per_gpu == pytest.approx(published, rel=0.2), name


@pytest.mark.parametrize("weight, dims", [(True, 1), (False, 1), (True, 2)])
def test_the_gpus_rms_norm_is_torchs(weight, dims):
    """The fused kernel's twin gives ``F.rms_norm``'s values and gradients (float64)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    shape = x.shape[-dims:]
    w = torch.randn(shape, dtype=torch.float64, generator=g, requires_grad=True) if weight else None
    dy = torch.randn(x.shape, dtype=torch.float64, generator=g)
    ours, ref = rms_norm(x, shape, w, 1e-6), F.rms_norm(x, shape, w, 1e-6)
    torch.testing.assert_close(ours, ref)
    inputs = [x, w] if weight else [x]
    for a, b in zip(torch.autograd.grad(ours, inputs, dy), torch.autograd.grad(ref, inputs, dy)):
        torch.testing.assert_close(a, b)


def test_a_gpu_trace_counts_one_kernel_per_rms_norm():
    """Under ``gpu_kernels`` an RMSNorm's traffic is the fused kernels': forward reads x and w and writes y and
    the fp32 reciprocal RMS; backward reads dy, x, the RMS and w and writes dx and dw. The CPU's chain moves
    several times that."""
    n, h = 64, 32
    norm = torch.nn.RMSNorm(h, dtype=torch.bfloat16)
    x = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)

    def traffic(fused: bool) -> float:
        with (gpu_kernels() if fused else torch.enable_grad()), OpCosts() as costs:
            norm(x).backward(torch.ones(n, h, dtype=torch.bfloat16))
        return costs.memory_bytes

    act, w, rstd = n * h * 2, h * 2, n * 4
    ones = act  # (the backward's seed, written by ones: counted as any factory's output)
    fused = (act + w + act + rstd) + (act + act + rstd + w + act + w)
    assert traffic(True) - ones == fused
    assert traffic(False) > 3 * fused
    assert F.rms_norm is not rms_norm  # (restored)


def test_attention_rates_by_keys():
    """The H100's attention rate: the project's measured point at 256 keys (head dim 72), the FlashAttention-3
    paper's cuDNN forward and backward at 512..16k keys as counted here (backward = 2 forwards of FLOPs:
    3 / (1/fwd + 2.5/bwd)), log-linear between, the nearest point's outside."""
    rates = GPUS["H100-80GB"].rates
    fwd, bwd = FA3_PAPER_CUDNN_H100[8192]
    assert rates.attention_tflops(8192) == pytest.approx(3 / (1 / fwd + 2.5 / bwd))
    assert rates.attention_tflops(256) == rates.attention_tflops(64) == 161.0
    assert rates.attention_tflops(1 << 20) == rates.attention_tflops(16384)
    low, high = rates.attention_tflops(4096), rates.attention_tflops(8192)
    assert rates.attention_tflops(int(4096 * math.sqrt(2))) == pytest.approx((low + high) / 2, rel=1e-3)
