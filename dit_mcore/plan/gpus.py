"""The devices a plan can target: memory, dense bf16 peak and link bandwidths (vendors' data sheets,
SXM parts), and the rates kernels reach on them (``rates``: from the one-GPU profiles in
``benchmarks/results/``, and, for attention over sequences longer than the project has measured, the
FlashAttention-3 paper's cuDNN figures; each named beside its figure). Any field can be overridden."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

from dit_mcore.errors import ConfigError
from dit_mcore.models.flops import PEAK_TFLOPS

GB = 1e9


@dataclass(frozen=True)
class Rates:
    """What the project's training step achieved on one device, by kind of work."""

    gemm_tflops: float
    """Matrix products (cuBLAS through megatron's linears, compiled)."""
    attention_points: tuple
    """``((s_k, TFLOPS), ...)``, ascending: attention kernels, forward + backward, by the number of keys each
    query attends to (FLOPs as counted: ``4 s_q s_k d`` per head forward, twice that backward)."""
    memory_gbs: float
    """The other operators' traffic as the eager trace counts it (compile fuses some: an effective rate)."""
    source: str

    def attention_tflops(self, keys: int) -> float:
        """The rate at ``keys`` keys per query: log-linear between the points, the nearest point's outside them."""
        lengths = [s for s, _ in self.attention_points]
        i = bisect.bisect_left(lengths, keys)
        if i == 0 or i == len(lengths):
            return self.attention_points[min(i, len(lengths) - 1)][1]
        (s0, r0), (s1, r1) = self.attention_points[i - 1], self.attention_points[i]
        return r0 + (r1 - r0) * math.log(keys / s0) / math.log(s1 / s0)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    """What ``torch.cuda.get_device_properties().total_memory`` reports (H200: 143,771 MiB in the leases here)."""
    bf16_tflops: float
    """The dense peak MFU is measured against (the step time comes from :attr:`rates`)."""
    nvlink_gbs: float
    """Per direction, per GPU, inside a node."""
    network_gbs: float
    """Per direction, per GPU, between nodes (InfiniBand / RoCE)."""
    workspace_gib: float
    """Held outside the tensors a step creates: CUDA context, cuBLAS and NCCL workspaces, allocator slack."""
    rates: Rates
    pcie_gbs: float = 64.0
    """Host <-> device, per direction, per GPU (PCIe Gen5 x16; data sheet, not measured here): what
    ``optim.cpu_offload`` moves each step."""
    host_gbs: float = 77.0
    """The host memory bandwidth a GPU's share of its node's CPUs has for the offloaded AdamW (data sheets, not
    measured here: a DGX H100's two Xeon 8480C, 16 channels of DDR5-4800, 614 GB/s over 8 GPUs)."""


# H200 rates: DiT-XL/2 at batch 128, compiled, bf16 (benchmarks/results/h200_2026-11-26_profile.md, call 2):
# GEMMs 87.85 TFLOP in 120.3 ms, cuDNN attention 3.25 TFLOP in 19.4 ms (256 keys, head dim 72), the other
# kernels 77.3 ms for the 244.7 GB the eager trace counts. H100: the same point on an H100
# (h100_2026-11-27.md): GEMMs 123.0 ms, attention 20.2 ms, the other kernels 75.0 ms.
#
# Longer sequences, not yet measured here (the runbook's `rates` phase measures them: benchmarks/attention_rates.py): cuDNN's forward and
# backward TFLOPS on an H100 SXM5, bf16, head dim 128, non-causal, from the FlashAttention-3 paper
# (Shah et al., arXiv 2407.08608, figures 5 and 6), by sequence length. The paper counts the backward as
# 2.5 forwards (it recomputes Q K^T); counted as here (twice), the pair's rate is 3 / (1/fwd + 2.5/bwd).
FA3_PAPER_CUDNN_H100 = {512: (497, 305), 1024: (574, 408), 2048: (617, 465), 4096: (609, 499), 8192: (600, 518),
                        16384: (595, 516)}


def _published_attention() -> tuple:
    return tuple((s, 3.0 / (1.0 / fwd + 2.5 / bwd)) for s, (fwd, bwd) in sorted(FA3_PAPER_CUDNN_H100.items()))


_LONG = "longer keys: the FlashAttention-3 paper's cuDNN figures (H100, head dim 128)"
# (the H200 has the H100's tensor cores and clocks: its long-sequence attention taken as the H100's)
_H200 = Rates(gemm_tflops=730.0, attention_points=((256, 168.0), *_published_attention()), memory_gbs=3170.0,
              source=f"benchmarks/results/h200_2026-11-26_profile.md (DiT-XL/2, batch 128); {_LONG}")
_H100 = Rates(gemm_tflops=714.0, attention_points=((256, 161.0), *_published_attention()), memory_gbs=3260.0,
              source=f"benchmarks/results/h100_2026-11-27.md (DiT-XL/2, batch 128); {_LONG}")


def _scaled(rates: Rates, by: float, name: str) -> Rates:
    return Rates(rates.gemm_tflops * by, tuple((s, r * by) for s, r in rates.attention_points), rates.memory_gbs * by,
                 f"H100's rates scaled by peak to {name} (not measured here)")


GPUS = {g.name: g for g in (
    GPU("H100-80GB", 79.2, PEAK_TFLOPS["H100"]["bf16"], 450.0, 50.0, 3.0, _H100),
    GPU("H200", 140.4, PEAK_TFLOPS["H200"]["bf16"], 450.0, 50.0, 3.0, _H200),
    GPU("B200", 167.6, PEAK_TFLOPS["B200"]["bf16"], 900.0, 50.0, 3.0,  # (DGX B200: Xeon 8570, DDR5-5600)
        _scaled(_H100, PEAK_TFLOPS["B200"]["bf16"] / PEAK_TFLOPS["H100"]["bf16"], "B200"), host_gbs=90.0),
    GPU("A100-80GB", 79.2, PEAK_TFLOPS["A100"]["bf16"], 300.0, 25.0, 3.0,  # (PCIe Gen4; DGX A100: EPYC 7742, DDR4)
        _scaled(_H100, PEAK_TFLOPS["A100"]["bf16"] / PEAK_TFLOPS["H100"]["bf16"], "A100"), pcie_gbs=32.0,
        host_gbs=51.0),
)}


def gpu(name: str, **overrides) -> GPU:
    """The table's entry for ``name`` with ``overrides`` (fields of :class:`GPU`, None: kept)."""
    if name not in GPUS:
        raise ConfigError(f"--gpu {name!r} is not in the table; use one of {sorted(GPUS)}, or the nearest one with "
                          "--gpu-memory-gib / --peak-tflops / --nvlink-gbs / --network-gbs")
    return replace(GPUS[name], **{k: v for k, v in overrides.items() if v is not None})
