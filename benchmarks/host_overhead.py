"""The host's time to queue a compiled packed text DiT's step: packed attention as one operator in the
compiled layer (``planned``, kernels.planned_attention) against outside the graph (``outside``: the
layer in pieces, as before), same process, with the ratio.

A 3B DiT at batch 1 on an H100 is host-bound: the host took 243-292 ms to queue an 8k-token
micro-batch, about the device's time to run it. That host cost is Python and dispatch, so the CPU
measures it: llama-tiny widths at a real model's depth (24 layers, as MovieGen-3B), packed mock
video with text, and on the CPU the GPU's varlen attention kernels emulated by zero outputs (the
CPU's own packed path loops over samples, which the GPU's does not), so the kernels cost next to
nothing and the step's time is the host's. On a GPU the real kernels run and the point is the
host's time per phase (``throughput.py``'s ``host_ms_per_step``).

    python benchmarks/host_overhead.py                 # CPU: 24 layers, 512-token packs
    python benchmarks/host_overhead.py --family stdit  # the ST-DiT (spatial, temporal and text attention)
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import dataclasses
import sys
from pathlib import Path

import torch

from results_io import device_name, write_result  # noqa: E402  (benchmarks/ is the script folder)
import throughput  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def emulated_varlen_kernels():
    """On the CPU, inside the block: the varlen kernels the GPU runs for packed attention, as zero
    outputs of their shapes (the host's work around them stays: plans, packing views, the op)."""
    from dit_mcore.kernels import attention_kernels as ak

    def forward(q, k, v, vl, scale):
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)

    def backward(dout, q, k, v, out, lse, vl, scale):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cpu = ak.KERNELS["flash_cpu"]
    ak.KERNELS["flash_cpu"] = dataclasses.replace(cpu, varlen_forward=forward, varlen_backward=backward)
    try:
        yield
    finally:
        ak.KERNELS["flash_cpu"] = cpu


PRESETS = {"llama": "llama-tiny", "stdit": "stdit-tiny"}


def measure(mode: str, layers: int, packed_len: int, warmup: int, steps: int, family: str = "llama") -> dict:
    """Host milliseconds per step (and per layer) of the compiled trainer with packed attention ``mode``,
    timed by ``throughput.measure`` (warmed up past compiles; the host's time per phase)."""
    from dit_mcore.models.core_attention import KernelsCoreAttention

    plannable = KernelsCoreAttention._plannable
    if mode == "outside":
        KernelsCoreAttention._plannable = lambda self, params: False
    try:
        row = throughput.measure({"family": family, "preset": PRESETS[family], "num_layers": layers, "image_size": 8,
                                  "frame_side": 8, "packed_len": packed_len, "batch": 1, "recompute": "none",
                                  "compile": True, "dtype": "bf16" if torch.cuda.is_available() else "fp32"},
                                 warmup, steps)
    finally:
        KernelsCoreAttention._plannable = plannable
    queued = row["host_ms_per_step"]["forward_backward"]
    return {"step_ms": row["step_s"] * 1e3, "forward_backward_ms": queued, "forward_backward_ms_per_layer": queued / layers}


@contextlib.contextmanager
def compile_backend(backend: str):
    """Every ``torch.compile`` inside (the layers' ``nn.Module.compile`` calls it) with ``backend``."""
    original = torch.compile
    if backend != "inductor":
        torch.compile = functools.partial(original, backend=backend)
    try:
        yield
    finally:
        torch.compile = original


def main(argv=None) -> dict:
    import warnings
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(PRESETS), default="llama")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--packed-len", type=int, default=512, help="tokens per pack (of 1, 4 and 8 frames of 16 tokens: >= 128)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs of each placement, interleaved; the median is reported")
    p.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager"),
                   help="torch.compile's backend: aot_eager traces the same graphs without Inductor's code "
                        "generation (the test suite's smoke run checks the harness, not Inductor)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = {"device": device_name(), "family": args.family, "layers": args.layers, "packed_len": args.packed_len,
              "command": "python benchmarks/host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "kernels": "real" if torch.cuda.is_available() else "varlen emulated by zero outputs",
              "compile_backend": args.compile_backend}
    runs = {"outside": [], "planned": []}
    with emulated_varlen_kernels() if not torch.cuda.is_available() else contextlib.nullcontext(), \
            compile_backend(args.compile_backend):
        for _ in range(args.repeats):  # interleaved: a busy spell of the host falls on both
            for mode, times in runs.items():
                times.append(measure(mode, args.layers, args.packed_len, args.warmup, args.steps, args.family))
    for mode, times in runs.items():  # the run of median host time
        result[mode] = sorted(times, key=lambda r: r["forward_backward_ms"])[len(times) // 2]
        result[mode]["forward_backward_ms_runs"] = [r["forward_backward_ms"] for r in times]
        print(f"{mode:8s} step {result[mode]['step_ms']:7.1f} ms, forward+backward queued in "
              f"{result[mode]['forward_backward_ms']:7.1f} ms ({result[mode]['forward_backward_ms_per_layer']:.2f} "
              "ms per layer)", flush=True)
    result["ratio_outside_over_planned"] = result["outside"]["forward_backward_ms"] / result["planned"]["forward_backward_ms"]
    print(f"host time to queue forward+backward, outside / planned: {result['ratio_outside_over_planned']:.2f}x")
    print("wrote", write_result("host_overhead" if args.family == "llama" else f"host_overhead_{args.family}", result,
                                args.out))
    return result


if __name__ == "__main__":
    main()
