"""Forward+backward time of the DiT MLP's tanh-GELU under ``torch.compile``: ours
(``dit_mcore.models.dit.config.gelu_tanh``, written as ``x * sigmoid(2z)`` when traced) against torch's
``F.gelu(x, approximate="tanh")``, on a ``[tokens, 4 x hidden]`` activation (DiT-XL/2's fc1 output).

Both compute the same function; Inductor lowers torch's ``tanh`` to libdevice's accurate tanh and our
``sigmoid`` to a fast exponential and a division. The H200 profile of a DiT-XL/2 step had the GELU
forward kernel at ~57% of the bandwidth a plain copy kernel reached there (2.7 vs 4.1 TB/s), which
points at instructions, not bytes. Each repeat times both back to back (interleaved); medians are
compared, with the bandwidth each reaches (forward: read x, write y; backward: read x and dy, write dx).

    python benchmarks/activation_speed.py            # GPU: bf16, 65,536 tokens (DiT-XL/2 at batch 256)

Prints ms per forward+backward, GB/s and the ratio torch / ours; writes
``benchmarks/results/activation_speed_<device>.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kernel_profile import sync_device  # noqa: E402  (benchmarks/ is the script folder)
from results_io import device_name, write_result  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dit_mcore.models.dit.config import gelu_tanh  # noqa: E402


def torch_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _step(fn, x, dy):
    x.grad = None
    fn(x).backward(dy)


def main(argv=None) -> dict:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=65536 if cuda else 4096)
    p.add_argument("--width", type=int, default=4608, help="4 x hidden (DiT-XL/2: 4608)")
    p.add_argument("--dtype", default="bf16" if cuda else "fp32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=20 if cuda else 3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    x = torch.randn(args.tokens, args.width, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    candidates = {"torch": torch.compile(torch_gelu_tanh), "ours": torch.compile(gelu_tanh)}
    with torch.no_grad():
        outs = {name: fn(x).float() for name, fn in candidates.items()}
    max_diff = (outs["torch"] - outs["ours"]).abs().max().item()
    for fn in candidates.values():  # compile both passes and warm up
        for _ in range(3):
            _step(fn, x, dy)
    times = {name: [] for name in candidates}
    for _ in range(args.repeats):
        for name, fn in candidates.items():
            sync_device(device)
            start = time.perf_counter()
            for _ in range(args.iters):
                _step(fn, x, dy)
            sync_device(device)
            times[name].append((time.perf_counter() - start) / args.iters)
    moved = 5 * x.numel() * x.element_size()  # forward 2 tensors, backward 3
    result = {"device": device_name(), "torch": torch.__version__, "dtype": args.dtype, "tokens": args.tokens,
              "width": args.width, "command": "python benchmarks/activation_speed.py " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "max_abs_diff_forward": max_diff}
    for name, t in times.items():
        ms = statistics.median(t) * 1e3
        result[name] = {"ms_fwd_bwd": ms, "gb_per_s": moved / (ms * 1e-3) / 1e9}
        print(f"{name:6s} {ms:8.3f} ms fwd+bwd  {result[name]['gb_per_s']:8.1f} GB/s")
    result["ratio_torch_over_ours"] = result["torch"]["ms_fwd_bwd"] / result["ours"]["ms_fwd_bwd"]
    print(f"torch / ours: {result['ratio_torch_over_ours']:.3f}x   (max |diff| of outputs {max_diff:.2e})")
    print("wrote", write_result("activation_speed", result, args.out))
    return result


if __name__ == "__main__":
    main()
