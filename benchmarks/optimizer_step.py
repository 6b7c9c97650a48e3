"""The per-parameter work of a bf16 step, side by side. First AdamW over flat buffers writing the bf16
weights in the same pass (``optim.adam_impl=flat``, ours) against torch's fused AdamW followed by
megatron's main-to-model weight copy (``fused``, megatron's path without apex/TE), both through
megatron's mixed-precision optimizer and DDP gradient buffer, on the parameter shapes of a DiT
layer stack (qkv, proj, fc1, fc2, adaLN, their biases and norm weights).

An H200 profile of the MovieGen-3B step had the fused AdamW at 26.6 ms (~3.2 TB/s) and the copy
among 19.3 ms of foreach kernels (~3.4 TB/s). Bytes per parameter: fused reads grad, weight and two
moments and writes three (28), the copy reads fp32 and writes bf16 (6): 34 in two passes; flat: 33
by Inductor's count (its group byte, the bf16 output counted read and written) in one generated
kernel. The gain to expect is bandwidth (a generated elementwise kernel reached 4.1 TB/s there),
not bytes. Third, the flat step with both moments in bf16 (``optim.exp_avg_dtype`` /
``exp_avg_sq_dtype``, stochastic rounding whose bits the kernel computes): 25 bytes per parameter,
and 4 bytes less state. Fourth, the flat step reading bf16 gradient buffers (``optim.main_grads_dtype``):
31 bytes per parameter. Fifth, the flat step over split main weights (``optim.split_main_params``: the bf16
weights plus int16 remainders, 2 bytes less state): 29. ``--traffic`` prints, without a GPU, what Inductor
schedules for the flat step and the EMA fold on an H100: their Triton kernels and bytes per parameter.

    python benchmarks/optimizer_step.py                       # GPU: MovieGen-3B's widths, 8 layers
    python benchmarks/optimizer_step.py --hidden 256 --ffn 1024 --layers 4   # CPU-sized
    python benchmarks/optimizer_step.py --traffic             # CPU: the H100 schedule of the flat step

Then the EMA update over the same weights (the trainer's next per-parameter pass): the trainer's fold
(``dit_mcore.training.ema._lerp``: a casting copy per bf16 parameter, then torch's foreach lerp, in groups:
18 bytes per parameter), against a fold compiled per tensor with dynamic shapes (:func:`fold_tensor`: 10
bytes; the trainer's CUDA path until the H200 ran it at 66 GB/s, Inductor having tuned its kernel for the
first call's size: ``results/h200_2026-11-29.md``), and the fold into host memory (``trainer.ema_offload``). On a GPU, last, what the offloaded fold's copies cost the
compute stream: matmuls queued after them, the copies fenced at once against on their side stream.

Each repeat times the candidates back to back (interleaved); prints median ms, the bytes per second
each reaches at the bytes per parameter above, and the ratios; writes
``benchmarks/results/optimizer_step_<device>.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from kernel_profile import sync_device  # noqa: E402  (benchmarks/ is the script folder)
from results_io import device_name, write_result  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dit_mcore.parallel.config import ParallelConfig  # noqa: E402
from dit_mcore.parallel.initialize import initialize_distributed  # noqa: E402
from dit_mcore.training.config import OptimConfig  # noqa: E402
from dit_mcore.training.optim import build_optimizer  # noqa: E402

BYTES_PER_PARAM = {"fused": 28 + 6, "flat": 33, "flat_bf16": 25, "flat_bf16_grads": 31, "flat_split": 29}
CANDIDATES = {"fused": ("fused", "fp32", "fp32", False), "flat": ("flat", "fp32", "fp32", False),
              "flat_bf16": ("flat", "bf16", "fp32", False), "flat_bf16_grads": ("flat", "fp32", "bf16", False),
              "flat_split": ("flat", "fp32", "fp32", True)}  # impl, moments, gradient buffers, split main weights


def fold_tensor(shadow: torch.Tensor, param: torch.Tensor, weight: torch.Tensor) -> None:
    """``shadow += weight * (param - shadow)``, the parameter read in its own dtype: compiled, one kernel
    that reads a bf16 parameter and the fp32 shadow and writes the shadow (10 bytes per parameter)."""
    shadow.lerp_(param.to(shadow.dtype), weight)


def ema_fold_traffic(n: int = 1 << 20) -> list:
    """The same for a compiled EMA fold of a bf16 parameter of ``n`` elements into its fp32 shadow."""
    from fusion_traffic import TrafficRecorder
    recorder = TrafficRecorder()
    step = torch.compile(fold_tensor, backend=recorder.backend, fullgraph=True, dynamic=False)
    step(torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.tensor(0.1))
    return [(k.fused, k.bytes / n) for k in recorder.kernels]


def flat_step_traffic(n: int = 1 << 20, moments: torch.dtype = torch.float32,
                      grads: torch.dtype = torch.float32, split: bool = False) -> list:
    """``(Triton kernel?, bytes per parameter)`` of each kernel Inductor schedules on an H100 for one
    flat AdamW step over ``n`` parameters (with gradient scale, skip flag and bf16 output; the moments
    of ``moments``, the gradients of ``grads``; ``split``: the main weights as the bf16 output and an
    int16 remainder), counted on the CPU (``fusion_traffic.TrafficRecorder``)."""
    from fusion_traffic import TrafficRecorder
    from dit_mcore.training.flat_adam import adamw_flat, variants
    recorder = TrafficRecorder()
    step = torch.compile(adamw_flat, backend=recorder.backend, fullgraph=True, dynamic=False)
    with variants():  # (a process that compiled the step's other variants already)
        step(None if split else torch.randn(n), torch.randn(n).to(grads), torch.zeros(n, dtype=moments),
             torch.zeros(n, dtype=moments), torch.zeros(n, dtype=torch.uint8),
             torch.tensor([[1e-3, 0.1], [1e-3, 0.0]]), torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0.0),
             torch.randn(n).to(torch.bfloat16), torch.tensor(0), torch.zeros(n, dtype=torch.int16) if split else None,
             beta1=0.9, beta2=0.999, eps=1e-8)
    return [(k.fused, k.bytes / n) for k in recorder.kernels]


def layer_stack(hidden: int, ffn: int, layers: int) -> torch.nn.Module:
    """Linears (with biases) and norm weights of the shapes of a DiT layer stack, as megatron's
    optimizer groups them (weights decayed; biases and norms not)."""
    def layer():
        return torch.nn.ModuleDict({"qkv": torch.nn.Linear(hidden, 3 * hidden), "proj": torch.nn.Linear(hidden, hidden),
                                    "fc1": torch.nn.Linear(hidden, ffn), "fc2": torch.nn.Linear(ffn, hidden),
                                    "adaln": torch.nn.Linear(hidden, 6 * hidden),
                                    "norm": torch.nn.LayerNorm(hidden)})
    return torch.nn.ModuleList([layer() for _ in range(layers)])


def build(impl: str, moments: str, grads: str, split_mains: bool, args, device) -> tuple:
    """(megatron optimizer, DDP wrapper) over a fresh layer stack in bf16 with random gradients."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    torch.manual_seed(0)
    module = layer_stack(args.hidden, args.ffn, args.layers).to(device=device, dtype=torch.bfloat16)
    config = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1, bf16=True,
                               params_dtype=torch.bfloat16)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=grads == "fp32"), module)
    optim = OptimConfig(lr=1e-4, weight_decay=0.1, adam_impl=impl, exp_avg_dtype=moments, exp_avg_sq_dtype=moments,
                        main_grads_dtype=grads, split_main_params=split_mains)
    optimizer, _ = build_optimizer([ddp], optim, bf16=True, max_steps=1000)
    for buffer in ddp.buffers:
        buffer.grad_data.normal_(generator=torch.Generator(device).manual_seed(1))
    return optimizer, ddp


def step(optimizer) -> None:
    """The optimizer step after the gradients are ready: gradients into the main weights' .grad,
    the update, the weights into the bf16 model (megatron's ``step_with_ready_grads``)."""
    optimizer.prepare_grads()
    optimizer.step_with_ready_grads()


def ema_side_by_side(module, args, device) -> dict:
    """The EMA update over the same bf16 weights into an fp32 shadow: the trainer's (a casting copy per
    parameter, then torch's foreach lerp, in groups: 18 bytes per parameter) against a compiled fold (10);
    and the fold into a shadow in host memory (``trainer.ema_offload``: the copy to pinned buffers and
    the host lerp, waited for), as nanoseconds per parameter, to size ``trainer.ema_every`` by. Each
    also gives the host's time to queue it (``host_ms_to_queue``): on a GPU, near the update's own
    time the update waits for the host (a call per tensor), well under it for the device."""
    from dit_mcore.training.ema import _lerp
    from dit_mcore.training.host_fold import HostFold
    params = [p.detach() for p in module.parameters()]
    shadows = {name: [p.float() for p in params] for name in ("eager", "compiled")}
    shadows["host"] = [p.float().cpu() for p in params]
    host_fold = HostFold(params)
    weight = torch.tensor(1e-4, device=device)
    step_fold = torch.compile(fold_tensor, dynamic=True)

    def compiled():  # a call per tensor, flat
        for s, p in zip(shadows["compiled"], params):
            step_fold(s.view(-1).detach(), p.view(-1).detach(), weight)

    def host():
        host_fold.start(shadows["host"], params, 1e-4)
        host_fold.wait()

    candidates = {"eager": lambda: _lerp(shadows["eager"], params, 1e-4),
                  "compiled": compiled, "host": host}
    for fn in candidates.values():
        for _ in range(3):
            fn()
    times, queued = {name: [] for name in candidates}, {name: [] for name in candidates}
    for _ in range(args.repeats):
        for name, fn in candidates.items():
            sync_device(device)
            start = time.perf_counter()
            for _ in range(args.iters):
                fn()
            queued[name].append((time.perf_counter() - start) / args.iters)  # the host's part
            sync_device(device)
            times[name].append((time.perf_counter() - start) / args.iters)
    n = sum(p.numel() for p in params)
    result = {"max_abs_diff": max((a - b).abs().max().item() for a, b in zip(shadows["eager"], shadows["compiled"])),
              "max_abs_diff_host": max((a.cpu() - b).abs().max().item() for a, b in zip(shadows["eager"], shadows["host"])),
              "host_workers": host_fold.workers}
    for name, t in times.items():
        ms = statistics.median(t) * 1e3
        result[name] = {"ms_per_update": ms, "gb_per_s": (18 if name == "eager" else 10) * n / (ms * 1e-3) / 1e9,
                        "ns_per_parameter": ms * 1e6 / n,  # (the host fold waits inside: all of it is the host's)
                        "host_ms_to_queue": statistics.median(queued[name]) * 1e3 if name != "host" else None}
        queue = (f"  (the host queued it in {result[name]['host_ms_to_queue']:.3f} ms, {len(params)} tensors)"
                 if name != "host" else "")
        print(f"EMA {name:8s} {ms:8.3f} ms per update  {result[name]['gb_per_s']:8.1f} GB/s  "
              f"{result[name]['ns_per_parameter']:.2f} ns/param{queue}")
    result["ratio_eager_over_compiled"] = result["eager"]["ms_per_update"] / result["compiled"]["ms_per_update"]
    result["ratio_host_over_eager"] = result["host"]["ms_per_update"] / result["eager"]["ms_per_update"]
    print(f"EMA eager / compiled: {result['ratio_eager_over_compiled']:.3f}x   (max |diff| {result['max_abs_diff']:.2e})")
    print(f"EMA host / eager: {result['ratio_host_over_eager']:.3f}x the time ({host_fold.workers} host threads; max |diff| "
          f"{result['max_abs_diff_host']:.2e})")
    if device.type == "cuda":
        result["host_copies_beside_compute"] = host_copies_beside_compute(host_fold, shadows["host"], params, args)
    return result


def host_copies_beside_compute(host_fold, shadow, params, args) -> dict:
    """What an offloaded fold costs the compute stream: the device time of ``[the fold's copies queued
    (as the trainer queues them, right after an update); matmuls sized like the copies (the next
    forward); the next update's fence]`` with the copies fenced at once (the compute stream waits for
    them, as when they were queued on it) against fenced after the matmuls (on their side stream,
    beside them), same process; with the process's ``CUDA_DEVICE_MAX_CONNECTIONS`` (the Docker image
    sets 1: one hardware queue). The host lerp is waited for outside the timing."""
    a = torch.randn(8192, 8192, device=params[0].device, dtype=torch.bfloat16)
    alone = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host_fold.start(shadow, params, 1e-4)
        host_fold.fence()
        torch.cuda.synchronize()
        alone.append(time.perf_counter() - start)
        host_fold.wait()
    copies = statistics.median(alone)
    a @ a  # (cuBLAS's first call picks its kernel)
    torch.cuda.synchronize()
    start = time.perf_counter()
    a @ a
    torch.cuda.synchronize()
    matmuls = max(1, round(copies / (time.perf_counter() - start)))
    times = {"fenced_at_once": [], "side_stream": []}
    for _ in range(args.repeats):
        for name in times:
            torch.cuda.synchronize()
            start = time.perf_counter()
            host_fold.start(shadow, params, 1e-4)
            if name == "fenced_at_once":
                host_fold.fence()
            for _ in range(matmuls):
                a @ a
            host_fold.fence()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            host_fold.wait()
    result = {"copies_ms": copies * 1e3, "matmuls": matmuls,
              "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
              **{name: statistics.median(t) * 1e3 for name, t in times.items()}}
    result["ratio"] = result["fenced_at_once"] / result["side_stream"]
    print(f"EMA host copies {result['copies_ms']:.1f} ms; with {matmuls} matmuls after them: fenced at once "
          f"{result['fenced_at_once']:.1f} ms, on the side stream {result['side_stream']:.1f} ms: {result['ratio']:.2f}x")
    return result


def main(argv=None) -> dict:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=3072 if cuda else 256, help="MovieGen-3B: 3072")
    p.add_argument("--ffn", type=int, default=8192 if cuda else 1024, help="MovieGen-3B: 8192")
    p.add_argument("--layers", type=int, default=8 if cuda else 4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=10 if cuda else 3)
    p.add_argument("--traffic", action="store_true", help="print the H100 kernels of the flat step and the EMA fold (no GPU needed)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.traffic:
        kernels = {"flat_adamw": flat_step_traffic(), "flat_adamw_bf16_moments": flat_step_traffic(moments=torch.bfloat16),
                   "flat_adamw_bf16_grads": flat_step_traffic(grads=torch.bfloat16),
                   "flat_adamw_split_main_weights": flat_step_traffic(split=True), "ema_fold": ema_fold_traffic()}
        for name, found in kernels.items():
            for fused, per_param in found:
                print(f"{name}: {'Triton' if fused else 'extern'} kernel, {per_param:.2f} bytes per parameter")
        return kernels

    initialize_distributed(ParallelConfig(), seed=0)
    device = torch.device("cuda" if cuda else "cpu")
    runs = {name: build(*how, args, device) for name, how in CANDIDATES.items()}
    params = sum(p.numel() for p in runs["flat"][1].module.parameters())
    for optimizer, _ in runs.values():  # the first steps compile the flat kernel and allocate state
        for _ in range(3):
            step(optimizer)
    weights = {name: [p.detach().float() for p in ddp.module.parameters()] for name, (_, ddp) in runs.items()}
    max_diff = max((a - b).abs().max().item() for a, b in zip(weights["fused"], weights["flat"]))
    max_diff_bf16 = max((a - b).abs().max().item() for a, b in zip(weights["fused"], weights["flat_bf16"]))
    max_diff_grads = max((a - b).abs().max().item() for a, b in zip(weights["flat"], weights["flat_bf16_grads"]))
    max_diff_split = max((a - b).abs().max().item() for a, b in zip(weights["flat"], weights["flat_split"]))
    times = {impl: [] for impl in runs}
    for _ in range(args.repeats):
        for impl, (optimizer, _) in runs.items():
            sync_device(device)
            start = time.perf_counter()
            for _ in range(args.iters):
                step(optimizer)
            sync_device(device)
            times[impl].append((time.perf_counter() - start) / args.iters)
    result = {"device": device_name(), "torch": torch.__version__, "parameters": params,
              "hidden": args.hidden, "ffn": args.ffn, "layers": args.layers,
              "command": "python benchmarks/optimizer_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "max_abs_weight_diff_after_3_steps": max_diff, "max_abs_weight_diff_bf16_moments": max_diff_bf16,
              "max_abs_weight_diff_bf16_grads": max_diff_grads, "max_abs_weight_diff_split": max_diff_split}
    for impl, t in times.items():
        ms = statistics.median(t) * 1e3
        result[impl] = {"ms_per_step": ms, "gb_per_s": BYTES_PER_PARAM[impl] * params / (ms * 1e-3) / 1e9}
        print(f"{impl:15s} {ms:8.3f} ms per optimizer step  {result[impl]['gb_per_s']:8.1f} GB/s "
              f"({BYTES_PER_PARAM[impl]} B/param, {params / 1e6:.0f}M parameters)")
    result["ratio_fused_over_flat"] = result["fused"]["ms_per_step"] / result["flat"]["ms_per_step"]
    result["ratio_flat_over_flat_bf16"] = result["flat"]["ms_per_step"] / result["flat_bf16"]["ms_per_step"]
    print(f"fused+copy / flat: {result['ratio_fused_over_flat']:.3f}x   (max |weight diff| after 3 steps {max_diff:.2e})")
    print(f"flat / flat with bf16 moments: {result['ratio_flat_over_flat_bf16']:.3f}x   "
          f"(max |weight diff| to fused after 3 steps {max_diff_bf16:.2e})")
    result["ratio_flat_over_flat_bf16_grads"] = result["flat"]["ms_per_step"] / result["flat_bf16_grads"]["ms_per_step"]
    print(f"flat / flat on bf16 gradient buffers: {result['ratio_flat_over_flat_bf16_grads']:.3f}x   "
          f"(max |weight diff| to flat after 3 steps {max_diff_grads:.2e}: the gradients drawn in bf16)")
    result["ratio_flat_over_flat_split"] = result["flat"]["ms_per_step"] / result["flat_split"]["ms_per_step"]
    print(f"flat / flat with split main weights: {result['ratio_flat_over_flat_split']:.3f}x   "
          f"(max |weight diff| to flat after 3 steps {max_diff_split:.2e}: rounding ties only)")
    result["ema"] = ema_side_by_side(runs["flat"][1].module, args, device)
    print("wrote", write_result("optimizer_step", result, args.out))
    return result


if __name__ == "__main__":
    main()
