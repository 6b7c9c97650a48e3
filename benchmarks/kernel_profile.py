"""Where a training step's device time goes: the top kernels and the time per kind of kernel
(GEMM, attention, compiler-fused Triton, eager elementwise/reduction, optimizer, copies,
collectives), plus how busy the device was over the profiled steps' wall time (a low share means
the host, not the GPU, sets the pace). Used by ``train_step.py --profile`` and
``throughput.py --profile``.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import torch

# First match wins; the order puts the specific names before the generic ones. "optimizer" holds every
# multi-tensor (foreach) kernel: the Adam update, the gradient norm, zeroing and the eager EMA lerp; and
# the per-parameter Triton kernels generated for the flat AdamW (optim.adam_impl=flat) and the EMA's
# compiled fold, named after their ops, lerp among them (no model kernel uses lerp).
KINDS = (
    ("optimizer", r"adam|multi_tensor_apply|foreach|_fused_sgd|^triton_\w*_lerp_"),
    ("attention", r"flash|fmha|sdpa|attention|attn"),
    ("collective", r"nccl|all_?reduce|all_?gather|reduce_?scatter|alltoall"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|cublas|wgmma|matmul|sm90_|sm80_|s16816|ampere_|float8|scaled_mm"
             r"|aten::(add)?mm$|aten::bmm"),
    ("triton", r"^triton_"),
    ("copy", r"memcpy|memset|copy|cat_|catarray|transpose|permute|index"),
    ("reduction", r"reduce|norm|softmax|sum_|welford"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|functor"),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower() if not kernel.startswith("triton_") else kernel
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def sync_device(device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(run_steps, device, n_steps: int = 3, top: int = 15) -> dict:
    """Profile ``run_steps(n_steps)`` (it runs that many steps, e.g. ``Trainer.train_steps``): ``top`` kernels by device time (ms per step, share,
    calls per step), ``kinds`` (ms per step and share per kind), ``busy`` (kernel time over wall
    time; kernels of several streams overlapping, e.g. NCCL beside compute, can take it past 1),
    ``host_syncs_per_step`` (stream synchronisations: ``.item()``, ``tolist()`` …; after each
    the device idles until the host queues more), ``event_waits_per_step`` (waits for one event,
    e.g. an offloaded EMA's copies), ``wall_ms_per_step``
    and ``runtime``: the CUDA runtime calls the host spent most time in (ms and calls per step; a
    copy from pageable memory that waited for the stream shows as a long ``cudaMemcpyAsync``). On the CPU
    the same over CPU operators (``busy`` and the syncs are None)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    sync_device(device)
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run_steps(n_steps)
        sync_device(device)
        wall = time.perf_counter() - start
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    events = [e for e in averages if getattr(e, attr) > 0]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    syncs = sum(e.count for e in averages if e.key == "cudaStreamSynchronize")
    event_waits = sum(e.count for e in averages if e.key == "cudaEventSynchronize")
    runtime = sorted((e for e in averages if e.key.startswith("cuda") and e.cpu_time_total > 0),
                     key=lambda e: e.cpu_time_total, reverse=True)[:6] if cuda else []
    kinds: dict[str, float] = {}
    for e in events:
        kind = kind_of(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + getattr(e, attr)
    return {
        "top": [{"kernel": e.key[:120], "kind": kind_of(e.key), "ms_per_step": getattr(e, attr) / 1e3 / n_steps,
                 "share": getattr(e, attr) / total, "calls_per_step": e.count / n_steps} for e in events[:top]],
        "kinds": {k: {"ms_per_step": v / 1e3 / n_steps, "share": v / total}
                  for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "busy": total / 1e6 / wall if cuda else None,
        "host_syncs_per_step": syncs / n_steps if cuda else None,
        "event_waits_per_step": event_waits / n_steps if cuda else None,
        "wall_ms_per_step": wall * 1e3 / n_steps,
        "runtime": [{"call": e.key, "host_ms_per_step": e.cpu_time_total / 1e3 / n_steps,
                     "calls_per_step": e.count / n_steps} for e in runtime],
    }


def host_profile_steps(run_steps, device, n_steps: int = 3, top: int = 25) -> list[dict]:
    """Where the host's time goes over ``run_steps(n_steps)`` (Python's deterministic profiler):
    the ``top`` functions by their own time (ms and calls per step, and the time with what they
    call). Where the device idles while the host hardly waits (``throughput.py``'s host phases),
    the host is the pace, and these are the functions to cut. The profiler slows Python calls
    (a few µs each), not the kernels they queue, so it shows the share, not the speed."""
    import cProfile
    import pstats
    sync_device(device)
    profiler = cProfile.Profile()
    profiler.enable()
    run_steps(n_steps)
    sync_device(device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, total s, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(file).name}:{line}({name})" if file != "~" else name,
             "calls_per_step": calls / n_steps, "own_ms_per_step": own * 1e3 / n_steps,
             "total_ms_per_step": total * 1e3 / n_steps}
            for (file, line, name), (_, calls, own, total, _) in rows]


def host_report(rows: list[dict], top: int = 15) -> str:
    """The host profile as text: own ms per step, with callees, calls per step, function."""
    return "\n".join(["  host functions (own ms/step, with callees, calls/step):"] +
                     [f"    {r['own_ms_per_step']:8.2f} {r['total_ms_per_step']:9.2f} x{r['calls_per_step']:<7.0f} "
                      f"{r['function'][:110]}" for r in rows[:top]])


def report(title: str, profile: dict) -> str:
    """The profile as text: time per kind, then the top kernels."""
    busy = (f", device busy {100 * profile['busy']:.0f}% of wall, {profile['host_syncs_per_step']:.1f} host syncs, "
            f"{profile['event_waits_per_step']:.1f} event waits" if profile["busy"] is not None else "")
    lines = [f"{title}: {profile['wall_ms_per_step']:.1f} ms/step{busy}"]
    lines += [f"  {k:<12} {v['ms_per_step']:8.2f} ms {100 * v['share']:5.1f}%" for k, v in profile["kinds"].items()]
    if profile.get("runtime"):  # the host's time inside CUDA runtime calls: a long copy call blocked on the stream
        lines.append("  host in CUDA calls: " + ", ".join(f"{r['call']} {r['host_ms_per_step']:.1f} ms "
                                                        f"x{r['calls_per_step']:.0f}" for r in profile["runtime"]))
    lines += [f"    {r['ms_per_step']:8.2f} ms {100 * r['share']:5.1f}% x{r['calls_per_step']:<5.0f} [{r['kind']}] "
              f"{r['kernel']}" for r in profile["top"]]
    return "\n".join(lines)
