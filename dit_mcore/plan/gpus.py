"""The devices a plan can target: memory, dense bf16 peak and link bandwidths (vendors' data sheets,
SXM parts), and the rates this project's kernels reached on them (``rates``: from the one-GPU
profiles in ``benchmarks/results/``, named beside each figure). Any field can be overridden."""
from __future__ import annotations

from dataclasses import dataclass, replace

from dit_mcore.errors import ConfigError
from dit_mcore.models.flops import PEAK_TFLOPS

GB = 1e9


@dataclass(frozen=True)
class Rates:
    """What the project's training step achieved on one device, by kind of work."""

    gemm_tflops: float
    """Matrix products (cuBLAS through megatron's linears, compiled)."""
    attention_tflops: float
    """Attention kernels, forward + backward (``4 s^2 d`` per head forward, twice that backward)."""
    memory_gbs: float
    """The other operators' traffic as the eager trace counts it (compile fuses some: an effective rate)."""
    source: str


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


# H200 rates: DiT-XL/2 at batch 128, compiled, bf16 (benchmarks/results/h200_2026-11-26_profile.md, call 2):
# GEMMs 87.85 TFLOP in 120.3 ms, cuDNN attention 3.25 TFLOP in 19.4 ms, the other kernels 77.3 ms for the
# 244.7 GB the eager trace counts. H100: the same point on an H100 (h100_2026-11-27.md): GEMMs 123.0 ms,
# attention 20.2 ms, the other kernels 75.0 ms.
_H200 = Rates(gemm_tflops=730.0, attention_tflops=168.0, memory_gbs=3170.0,
              source="benchmarks/results/h200_2026-11-26_profile.md (DiT-XL/2, batch 128)")
_H100 = Rates(gemm_tflops=714.0, attention_tflops=161.0, memory_gbs=3260.0,
              source="benchmarks/results/h100_2026-11-27.md (DiT-XL/2, batch 128)")


def _scaled(rates: Rates, by: float, name: str) -> Rates:
    return Rates(rates.gemm_tflops * by, rates.attention_tflops * by, rates.memory_gbs * by,
                 f"H100's rates scaled by peak to {name} (not measured here)")


GPUS = {g.name: g for g in (
    GPU("H100-80GB", 79.2, PEAK_TFLOPS["H100"]["bf16"], 450.0, 50.0, 3.0, _H100),
    GPU("H200", 140.4, PEAK_TFLOPS["H200"]["bf16"], 450.0, 50.0, 3.0, _H200),
    GPU("B200", 167.6, PEAK_TFLOPS["B200"]["bf16"], 900.0, 50.0, 3.0,
        _scaled(_H100, PEAK_TFLOPS["B200"]["bf16"] / PEAK_TFLOPS["H100"]["bf16"], "B200")),
    GPU("A100-80GB", 79.2, PEAK_TFLOPS["A100"]["bf16"], 300.0, 25.0, 3.0,
        _scaled(_H100, PEAK_TFLOPS["A100"]["bf16"] / PEAK_TFLOPS["H100"]["bf16"], "A100")),
)}


def gpu(name: str, **overrides) -> GPU:
    """The table's entry for ``name`` with ``overrides`` (fields of :class:`GPU`, None: kept)."""
    if name not in GPUS:
        raise ConfigError(f"--gpu {name!r} is not in the table; use one of {sorted(GPUS)}, or the nearest one with "
                          "--gpu-memory-gib / --peak-tflops / --nvlink-gbs / --network-gbs")
    return replace(GPUS[name], **{k: v for k, v in overrides.items() if v is not None})
