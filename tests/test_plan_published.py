"""The planner's step time against published multi-GPU runs it was not fitted to, and the device model under it:
the GPU's fused RMSNorm the trace runs in place of the CPU's decomposition, attention rates by sequence length.

The rows (`benchmarks/results/cpu_2026-12-01_plan_published_rows.md` says how each model shape was chosen):
- NeMo's DiT performance table (docs.nvidia.com/nemo-framework, "Diffusion Transformers (DiT)", performance:
  32 DGX-H100 nodes; 8k tokens = 256 frames at 256 px, 64k at 1024 px; the table's "74k" is 64k, as its text says);
  its "7B" is NeMo's ``DiT7BConfig`` (``cosmos_7b_text2world``: 28 x 4096, AdaLN-LoRA 256), whose FLOPs per token
  match the table's TFLOPS over tokens/s; the "28B" taken as 48 x 6144 with the same modulation (uncertain).
- Megatron-Bridge's Wan 2.1 14B (NVIDIA-NeMo/DFM ``examples/models/wan/performance-summary.md``: 128 H100s,
  37,440 tokens, GBS 128, TP2 + SP + CP4, megatron DDP, full recompute): 325.77 TFLOPS/GPU."""
import math

import pytest
import torch
import torch.nn.functional as F

from dit_mcore.plan import cli
from dit_mcore.plan.device_kernels import gpu_kernels, rms_norm
from dit_mcore.plan.gpus import FA3_PAPER_CUDNN_H100, GPUS
from dit_mcore.plan.op_costs import OpCosts
from megatron_env import single_process_world

_COSMOS_7B = ["--family", "dit_xattn", "--preset", "DiT-XAttn-7B-Cosmos", "--text-len", "256"]
_28B = [*_COSMOS_7B, "model.num_layers=48", "model.hidden_size=6144", "model.num_attention_heads=48"]
_WAN_14B = ["--family", "dit_xattn", "--preset", "DiT-XAttn-28B", "model.num_layers=40", "model.hidden_size=5120",
            "model.num_attention_heads=40", "model.ffn_hidden_size=13824", "model.text_dim=4096",
            "model.cross_attention_adaln=False", "model.adaln_lora_rank=1", "--text-len", "512"]
_8K, _64K = ["--seq", "8192", "--frames", "32"], ["--seq", "65536", "--frames", "64"]
# (name, command, published layout, published TFLOPS/GPU or None for OOM)
ROWS = [
    ("nemo_7b_8k_tp2", [*_COSMOS_7B, *_8K, "--gpus", "256", "--global-batch", "256"], "tp=2,distopt=1", 519.0),
    ("nemo_7b_64k_tp2_cp4", [*_COSMOS_7B, *_64K, "--gpus", "256", "--global-batch", "64"], "tp=2,cp=4,distopt=1",
     439.0),
    ("nemo_7b_8k_unoptimised", [*_COSMOS_7B, *_8K, "--gpus", "256", "--global-batch", "256"], "tp=1", None),
    ("nemo_28b_8k_tp4_pp4", [*_28B, *_8K, "--gpus", "256", "--global-batch", "256"], "tp=4,pp=4,distopt=1", 468.0),
    ("nemo_28b_64k_fsdp_recompute", [*_28B, *_64K, "--gpus", "256", "--global-batch", "256"],
     "fsdp=torch,recompute=full", 445.0),
    ("bridge_wan_14b_37k", [*_WAN_14B, "--seq", "37440", "--frames", "24", "--frame-width", "52", "--gpus", "128",
                            "--global-batch", "128"], "tp=2,cp=4,distopt=1,recompute=full", 325.77),
]


@pytest.fixture(scope="module")
def world():
    single_process_world()


@pytest.mark.parametrize("name, command, layout, published", ROWS, ids=[r[0] for r in ROWS])
def test_published_rows_within_20_percent(world, name, command, layout, published):
    """Predicted TFLOPS/GPU within 20% of each published row, the published layout fitting an H100-80GB; the
    row published as out of memory predicted out of memory."""
    planner = cli.planner_of(cli.parse_args([*command, "--gpu", "H100-80GB"]))
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
