"""Training throughput grid through the real trainer, on mock data: images/s, tokens/s, model
TFLOPS per GPU, MFU and peak memory per point, one JSON line each, plus PNG plots.

A point is one (preset, data shape, micro-batch, recompute, compile, precision, FP8 recipe); each is built as a
``Trainer`` on ``data.name=mock`` (dense image latents of ``--image-sizes``, or packed video-like
sequences of ``--packed-lens`` tokens), warmed up, then timed over ``--steps`` optimizer steps
(each step already ends on the host: the logged loss). FLOPs come from the trainer's own count
(``dit_mcore.models.flops``). ``--autotune`` replaces each point's batch by the largest that
fits (doubling, then bisecting on out-of-memory). ``--diffusers`` adds diffusers'
``DiTTransformer2DModel`` side by side for dense points (``benchmarks/train_step.py``'s pair: same
weights, batch, precision), with the ratio.

    python benchmarks/throughput.py --presets tiny --image-sizes 8 --batches 4 --steps 2   # CPU smoke
    python benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 32,64,128 \\
        --compile 0,1 --dtype bf16 --diffusers                                              # one GPU
    python benchmarks/throughput.py --presets DiT-XL/2 --packed-lens 4096,8192 --batches 1,2 \\
        --recompute none,selective --compile 1 --dtype bf16 --autotune
    python benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 1 \
        --dtype bf16 --fp8 none,rowwise,tensorwise                      # FP8 (torchao) next to bf16
    python benchmarks/throughput.py --presets DiT-XL/2 --image-sizes 32 --batches 128 --compile 0 \
        --dtype bf16 --fp8 none,te:delayed,te:tensorwise                # Transformer Engine's FP8 (needs TE)
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernel_profile import host_profile_steps, host_report, profile_steps, report  # noqa: E402  (benchmarks/ is the script folder)
from results_io import device_name, result_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["mlp"]),  # (core_attn: eager only)
    "norm": dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"]),  # eager only
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def run_config(point: dict, run_dir: str):
    """The ``RunConfig`` of one grid point (mock data, no checkpoints, no previews)."""
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.training.config import (DataConfig, DiffusionConfig, LogConfig, ModelConfig, OptimConfig,
                                           RunConfig, TrainerConfig)
    side, packed_len, batch = point["image_size"], point["packed_len"], point["batch"]
    accumulation = point.get("accumulation", 1)  # micro-batches per optimizer step
    frame = point.get("frame_side", 32)  # packed: latent frames of frame x frame
    fp8 = point.get("fp8")  # torchao's recipe, or "te:<recipe>": Transformer Engine's
    backend, fp8 = ("te", fp8[len("te:"):]) if fp8 and fp8.startswith("te:") else ("auto", fp8)
    if packed_len:  # video-like samples of 1/4/8 frames of 32x32 latents (patch 2: 256 tokens per frame)
        data = DataConfig(name="mock", image_size=frame, mock_latent_shapes=[[t, frame, frame] for t in (1, 4, 8)],
                          max_seq_len=packed_len, global_batch_size=batch * accumulation, micro_batch_size=batch)
    else:
        data = DataConfig(name="mock", image_size=side, global_batch_size=batch * accumulation, micro_batch_size=batch)
    return RunConfig(
        model=ModelConfig(family=point.get("family", "dit"), preset=point["preset"],
                          num_layers=point.get("num_layers"),  # None: the preset's
                          input_size=frame if packed_len else side, compile=point["compile"],
                          compile_mode=point.get("compile_mode") if point["compile"] else None,
                          compile_options=point.get("compile_options") if point["compile"] else None,
                          backend=backend, fp8=fp8, attention_backend=point.get("attention"),
                          aten_linears=point.get("aten_linears"),
                          fuse_wgrad_accumulation=point.get("wgrad_fusion"),
                          **RECOMPUTE[point["recompute"]]),
        data=data,
        optim=OptimConfig(lr=1e-4, warmup_steps=0, decay_style="constant", adam_impl=point.get("adam", "auto"),
                          exp_avg_dtype=point.get("moments", "fp32"), exp_avg_sq_dtype=point.get("moments", "fp32"),
                          main_grads_dtype=point.get("grads", "fp32"),
                          split_main_params=point.get("split_mains", False)),
        diffusion=DiffusionConfig(objective="flow"),
        trainer=TrainerConfig(max_steps=10 ** 6, bf16=point["dtype"] == "bf16", save_interval=10 ** 6,
                              ema_every=point.get("ema_every", 1), ema_offload=point.get("ema_offload", False)),
        log=LogConfig(dir=run_dir, log_interval=10 ** 6, sample_interval=0, tensorboard=False, progress_bar=False),
        parallel=ParallelConfig())


def measure(point: dict, warmup: int, steps: int, peak_override: float | None = None, profile: bool = False,
            host_profile: bool = False) -> dict:
    """Build the trainer for ``point`` and time ``steps`` steps after ``warmup`` (then, with
    ``profile``, profile three more: ``kernel_profile.profile_steps``; with ``host_profile``, the
    host's functions over three more: ``kernel_profile.host_profile_steps``)."""
    from dit_mcore.models.flops import peak_tflops
    from dit_mcore.training.trainer import Trainer

    if point["compile"]:  # each point compiles afresh: another batch size in the same process would
        torch.compiler.reset()  # otherwise get dynamo's dynamic-shape graphs (automatic_dynamic_shapes)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(run_config(point, run_dir))
        cuda = trainer.device.type == "cuda"
        warmed = warm_up(trainer.train_step, warmup)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        graphs, retries = compiled_graphs(), alloc_retries()
        start = time.perf_counter()
        with host_phases(trainer) as host:
            history = trainer.train_steps(steps)  # as fit runs them
        if cuda:  # the last host read is before the last update: count that update too
            torch.cuda.synchronize()
        trainer.ema.wait()  # and a host fold still running (trainer.ema_offload)
        elapsed = time.perf_counter() - start
        graphs, retries = compiled_graphs() - graphs, alloc_retries() - retries
        world = torch.distributed.get_world_size()
        samples, tokens = sum(h["samples"] for h in history), sum(h["tokens"] for h in history)
        tflops = sum(h["model_flops"] for h in history) / elapsed / world / 1e12
        peak = peak_tflops(trainer.device, point["dtype"], peak_override)
        result = {**point, "device": device_name(), "world_size": world, "step_s": elapsed / steps,
                  "images_per_s": samples / elapsed, "tokens_per_s_per_gpu": tokens / elapsed / world,
                  "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
                  "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
                  "state_gib": trainer.parallel_model.budget.total / 2 ** 30,  # weights, gradients, optimizer, EMA
                  "wgrad_in_gemm": getattr(trainer.ddp_chunks[0], "wgrad_accumulates_in_gemm", None),
                  "warmup_steps": warmed, "graphs_compiled_while_timed": graphs, "alloc_retries_while_timed": retries,
                  "host_ms_per_step": {k: v * 1e3 / steps for k, v in host.items()}}
        if profile:
            result["profile"] = profile_steps(trainer.train_steps, trainer.device)
        if host_profile:
            result["host_profile"] = host_profile_steps(trainer.train_steps, trainer.device)
        del trainer
    release_memory()
    return result


def release_memory() -> None:
    """Free the last point's device memory for the next one in the same process: its trainer's
    parameters, gradients and optimizer state are held by reference cycles (DDP's hooks) and by
    dynamo's compiled code until collected (an H100 ran out of memory building the second
    MovieGen-3B point of one process without this)."""
    import gc
    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile for a new shape counts)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def alloc_retries() -> int:
    """Times the CUDA caching allocator found no free block, freed its cache and retried (each a device
    sync and a flush: a step near the memory limit that does this is slow for it); 0 off CUDA."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0


HOST_PHASES = ("waits", "batch", "to_device", "forward_backward", "grad_norm", "train_step")


@contextlib.contextmanager
def host_phases(trainer):
    """Seconds the host spends in each phase of the steps run inside the block (a dict, filled as they
    run): ``waits`` for an offloaded EMA's host fold (``HostFold.wait``); ``batch``: the loader's
    global batch; ``to_device``: its micro-batches' copies (a pageable host-to-device copy can block
    the host until the stream reaches it); ``forward_backward``: queuing megatron's schedule;
    ``grad_norm``: the gradient norm's read (the step's one wait for the device: the backward);
    ``train_step``: the trainer's whole step. Next to the profile's device
    busy share they tell who is behind: a device idle while the host hardly waited was waiting for the
    host to queue work (host-bound), and the phase that takes the step's time is where."""
    from energon_data.batch import MicroBatch
    from dit_mcore.training import trainer as trainer_module
    from dit_mcore.training.host_fold import HostFold
    total = dict.fromkeys(HOST_PHASES, 0.0)

    def timed(name, method):
        def call(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                total[name] += time.perf_counter() - begin
        return call
    get_schedule = trainer_module.get_forward_backward_func
    patches = [(HostFold, "wait", "waits"), (MicroBatch, "to", "to_device"),
               (trainer.loader, "next_global_batch", "batch"), (trainer, "train_step", "train_step"),
               (trainer_module, "grads_and_norm", "grad_norm")]
    originals = [(owner, attr, owner.__dict__.get(attr)) for owner, attr, _ in patches]
    for owner, attr, name in patches:
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    trainer_module.get_forward_backward_func = lambda: timed("forward_backward", get_schedule())
    try:
        yield total
    finally:
        trainer_module.get_forward_backward_func = get_schedule
        for owner, attr, original in originals:
            if original is None:
                delattr(owner, attr)  # an instance's patch: its class's method shows again
            else:
                setattr(owner, attr, original)


def warm_up(step, steps: int, most_extra: int = 10) -> int:
    """Run ``steps`` steps, then more (up to ``most_extra``) while the last one still compiled a graph:
    packed batches change shape from step to step, and dynamo compiles a dynamic-shape graph only at
    the second or third shape it sees (an H100 timed a 3B point at 5.1 s per step with two warm-up
    steps, the third step's compile inside the timing). Returns the steps run."""
    run, before = 0, compiled_graphs()
    while run < steps or (run < steps + most_extra and compiled_graphs() > before):
        before = compiled_graphs()
        step()
        run += 1
    return run


def fits(point: dict) -> bool:
    try:
        measure(point, warmup=1, steps=1)
        return True
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return False


def autotune(point: dict, limit: int = 4096) -> int:
    """The largest batch that fits: double from the point's batch, then bisect."""
    lo, hi = 0, point["batch"]
    while hi <= limit and fits({**point, "batch": hi}):
        lo, hi = hi, hi * 2
    while hi - lo > 1 and lo:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits({**point, "batch": mid}) else (lo, mid)
    if not lo:
        raise RuntimeError(f"batch {point['batch']} does not fit for {point}; start lower")
    return lo


def diffusers_side_by_side(point: dict, steps: int) -> dict:
    """diffusers' DiT vs ours on the same weights and batch (the pair of ``train_step.py``)."""
    import train_step
    args = ["--preset", point["preset"], "--batch", str(point["batch"]), "--size", str(point["image_size"]),
            "--dtype", point["dtype"], "--rounds", "3", "--steps", str(max(steps // 3, 1)),
            "--out", str(Path(tempfile.gettempdir()) / "train_step_side_by_side.json")]
    if point["compile"]:
        args.append("--compile")
    r = train_step.main(args)
    return {"diffusers_images_per_s": r["images_per_s"]["diffusers"], "model_only_images_per_s": r["images_per_s"]["ours"],
            "ratio_over_diffusers": r["ratio_ours_over_diffusers"]}


def variant(point: dict) -> str:
    """A point's (or row's) settings that differ from the defaults, beyond preset, shape, batch,
    recompute, compile, precision and FP8: one label for the printout and the plots."""
    parts = [f"adam={point['adam']}" if point.get("adam", "auto") != "auto" else "",
             f"attention={point['attention']}" if point.get("attention") else "",
             "aten linears" if point.get("aten_linears", False) else "",
             "wgrad in GEMM" if point.get("wgrad_fusion", False) else "",
             f"accumulation={point['accumulation']}" if point.get("accumulation", 1) != 1 else "",
             f"ema_every={point['ema_every']}" if point.get("ema_every", 1) != 1 else "",
             "EMA offloaded" if point.get("ema_offload") else "",
             f"moments={point['moments']}" if point.get("moments", "fp32") != "fp32" else "",
             f"grads={point['grads']}" if point.get("grads", "fp32") != "fp32" else "",
             "main weights split" if point.get("split_mains") else "",
             "options=" + ",".join(f"{k}={v}" for k, v in point["compile_options"].items())
             if point.get("compile_options") else "",
             f"mode={point['compile_mode']}" if point.get("compile_mode") else ""]
    return "".join(f" {part}" for part in parts if part)


def plot(rows: list[dict], out: Path) -> list[Path]:
    """Throughput and MFU against batch (one line per preset x shape x compile x recompute x FP8 x the
    other settings, :func:`variant`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    paths = []
    for metric, label in (("images_per_s", "images/s"), ("tokens_per_s_per_gpu", "tokens/s/GPU"), ("mfu", "MFU")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        key = lambda r: (r["preset"], r["packed_len"] or r["image_size"], r["compile"], r["recompute"],  # noqa: E731
                         r.get("fp8") or "none", variant(r))
        for k, group in itertools.groupby(sorted(rows, key=key), key=key):
            group = sorted(group, key=lambda r: r["batch"])
            if any(r[metric] is None for r in group):
                continue
            shape = f"packed {k[1]}" if group[0]["packed_len"] else f"{k[1]}x{k[1]}"
            ax.plot([r["batch"] for r in group], [r[metric] for r in group], marker="o",
                    label=f"{k[0]} {shape} compile={int(k[2])} recompute={k[3]}"
                    + (f" fp8={k[4]}" if k[4] != "none" else "") + k[5])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batch")
        ax.set_ylabel(label)
        ax.set_title(f"{label} on {device_name()}")
        ax.legend(fontsize=7)
        path = out.with_name(f"{out.stem}_{metric}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _list(text: str, cast=str) -> list:
    return [cast(x) for x in text.split(",") if x != ""]


def compile_option_sets(text: str) -> list:
    """``--compile-options``: ';'-separated alternatives, each ``none`` or ``name=value,...`` (values
    as Python literals, else strings; no commas inside a value) -> a list of None / option dicts."""
    def value(v: str):
        try:
            return ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return v
    return [None if alt.strip() in ("", "none") else
            {k.strip(): value(v.strip()) for k, v in (item.split("=", 1) for item in alt.split(","))}
            for alt in text.split(";")]


def main(argv=None) -> list[dict]:
    from dit_mcore.models.float8 import RECIPES as FLOAT8_RECIPES
    from dit_mcore.models.te_fp8 import RECIPES as TE_FP8_RECIPES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="dit", help="model family of the presets (dit, dit_xattn, llama, stdit)")
    p.add_argument("--presets", default="DiT-XL/2")
    p.add_argument("--image-sizes", default="32", help="dense latent sides (32 = 256px images)")
    p.add_argument("--packed-lens", default="", help="packed video-like sequence lengths (tokens)")
    p.add_argument("--batches", default="32")
    p.add_argument("--recompute", default="none", help=f"any of {','.join(RECOMPUTE)}")
    p.add_argument("--compile", default="0", help="0, 1 or 0,1")
    p.add_argument("--dtype", default="bf16" if torch.cuda.is_available() else "fp32", help="bf16 or fp32")
    p.add_argument("--fp8", default="none", help="FP8 recipes of the transformer linears (model.fp8): any of "
                   f"none,{','.join(FLOAT8_RECIPES)} (torchao), {','.join('te:' + r for r in TE_FP8_RECIPES)} "
                   "(Transformer Engine's, model.backend=te, with --compile 0) (MFU stays against the --dtype peak)")
    p.add_argument("--adam", default="auto", help="optim.adam_impl: any of auto,fused,flat,foreach,megatron")
    p.add_argument("--accumulation", default="1", help="micro-batches per optimizer step (gradient accumulation: "
                   "the global batch is micro-batch x this): any of e.g. 1,4; the per-parameter work of a step "
                   "(gradient norm, AdamW, weight copies) is shared by that many micro-batches, as in real runs")
    p.add_argument("--ema-every", default="1", help="trainer.ema_every: any of e.g. 1,10 (optimizer steps between the "
                   "EMA's passes over the weights)")
    p.add_argument("--ema-offload", default="0", help="trainer.ema_offload: any of 0,1 (1: the EMA shadow in host "
                   "memory, folded there in a thread; 4 bytes per parameter off the GPU)")
    p.add_argument("--moments", default="fp32", help="optim.exp_avg_dtype and exp_avg_sq_dtype: any of fp32,bf16 "
                   "(bf16: Adam's moments in bf16 in the flat step, 4 bytes per parameter less)")
    p.add_argument("--grads", default="fp32", help="optim.main_grads_dtype: any of fp32,bf16 (bf16: megatron DDP's "
                   "gradient buffers in bf16, read by the flat step; bf16 runs only)")
    p.add_argument("--split-mains", default="0", help="optim.split_main_params: any of 0,1 (1: the fp32 main "
                   "weights as the bf16 weights plus int16 remainders, 2 bytes per parameter less; the flat step, "
                   "bf16 runs only)")
    p.add_argument("--compile-mode", default="default", help="model.compile_mode with --compile 1: any of "
                   "default,max-autotune-no-cudagraphs")
    p.add_argument("--compile-options", default="none", help="model.compile_options with --compile 1, alternatives "
                   "separated by ';', each 'none' or comma-separated Inductor options, e.g. "
                   "'none;triton.multi_kernel=1;coordinate_descent_tuning=True' (values of torch's type; reductions also generated persistent, "
                   "the faster picked on the device; block sizes tuned on the device)")
    p.add_argument("--aten-linears", default="0", help="model.aten_linears (experimental): any of 0,1 (0, the "
                   "default: megatron's linear autograd function; 1: the aten linears, to measure against it)")
    p.add_argument("--wgrad-fusion", default="0", help="model.fuse_wgrad_accumulation (experimental, with "
                   "--aten-linears 1): any of 0,1 (0, the default: megatron DDP's hook adds each weight gradient "
                   "into main_grad; 1: the accumulation inside the GEMM, to measure against it)")
    p.add_argument("--attention", default="auto", help="model.attention_backend: e.g. auto,sdpa_flash")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak for MFU (default: the GPU table; CPU: none unless given)")
    p.add_argument("--autotune", action="store_true", help="the largest micro-batch that fits, per point")
    p.add_argument("--host-profile", action="store_true",
                   help="profile the host's Python over three more steps (cProfile): where a host-bound step goes")
    p.add_argument("--diffusers", action="store_true", help="diffusers' DiT side by side on dense points")
    p.add_argument("--profile", action="store_true",
                   help="per point, the device time per kind of kernel and the top kernels of three more steps")
    p.add_argument("--out", default=None, help="JSON lines (default benchmarks/results/throughput_<device>.jsonl)")
    args = p.parse_args(argv)

    shapes = [{"image_size": s, "packed_len": None} for s in _list(args.image_sizes, int)] + \
             [{"image_size": 32, "packed_len": n} for n in _list(args.packed_lens, int)]
    points = [{"family": args.family, "preset": preset, **shape, "batch": batch, "recompute": rc, "compile": bool(int(c)), "dtype": args.dtype,
               "fp8": None if fp8 == "none" else fp8, "adam": adam, "attention": None if attn == "auto" else attn,
               "aten_linears": bool(int(aten)), "wgrad_fusion": bool(int(fuse)), "accumulation": acc,
               "ema_every": ema, "ema_offload": bool(int(offload)), "moments": moments, "grads": grads,
               "split_mains": bool(int(split)), "compile_options": options,
               "compile_mode": None if mode == "default" else mode}
              for preset, shape, batch, rc, c, fp8, adam, attn, aten, fuse, acc, ema, offload, moments, grads,
              split, options, mode
              in itertools.product(
                  _list(args.presets), shapes, _list(args.batches, int), _list(args.recompute), _list(args.compile),
                  _list(args.fp8), _list(args.adam), _list(args.attention),
                  _list(args.aten_linears), _list(args.wgrad_fusion), _list(args.accumulation, int),
                  _list(args.ema_every, int), _list(args.ema_offload), _list(args.moments), _list(args.grads),
                  _list(args.split_mains), compile_option_sets(args.compile_options),
                  _list(args.compile_mode))
              if not (rc == "norm" and int(c))  # norm recompute does not trace under compile
              and not (moments != "fp32" and adam in ("fused", "foreach"))  # bf16 moments: the flat step only
              and not (grads != "fp32" and args.dtype != "bf16")  # bf16 gradient buffers: bf16 runs only
              and not (int(split) and (args.dtype != "bf16" or adam in ("fused", "foreach")))  # split: flat, bf16
              and (int(c) or (mode == "default" and options is None))]  # a compile mode or options need compile
    out = result_path("throughput", args.out, ext="jsonl")
    command = "python benchmarks/throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = []
    with out.open("w") as f:
        for point in points:
            if args.autotune:
                point = {**point, "batch": autotune(point)}
            row = {**measure(point, args.warmup, args.steps, args.peak_tflops, args.profile, args.host_profile),
                   "command": command,
                   "autotuned": args.autotune}
            if args.diffusers and not point["packed_len"] and not point["fp8"]:  # diffusers has no FP8 pair
                row.update(diffusers_side_by_side(point, args.steps))
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
            ratio = f" | {row['ratio_over_diffusers']:.2f}x diffusers" if "ratio_over_diffusers" in row else ""
            shape = f"packed {point['packed_len']}" if point["packed_len"] else f"{point['image_size']}x{point['image_size']}"
            memory = (f" | peak {row['peak_memory_gib']:.1f} GiB (state {row['state_gib']:.1f})"
                      if row["peak_memory_gib"] is not None else "")
            memory += f" | host waited {row['host_ms_per_step']['grad_norm']:.1f} ms/step for the norm"
            print(f"{point['preset']} {shape} batch {point['batch']} recompute={point['recompute']} "
                  f"compile={int(point['compile'])} {point['dtype']}{' fp8=' + point['fp8'] if point['fp8'] else ''}: "
                  f"{row['images_per_s']:.1f} img/s | "
                  f"{row['tokens_per_s_per_gpu']:.0f} tok/s/GPU | {row['tflops_per_gpu']:.2f} TFLOPS/GPU | "
                  f"MFU {mfu}{ratio}{memory}{variant(point)}", flush=True)
            if row["graphs_compiled_while_timed"]:
                print(f"  ({row['graphs_compiled_while_timed']} graphs compiled while timed: not a steady-state speed; "
                      "raise --warmup)", flush=True)
            print("  host ms/step: " + ", ".join(f"{k} {v:.1f}" for k, v in row["host_ms_per_step"].items()),
                  flush=True)
            if "profile" in row:
                print(report("  profile", row["profile"]), flush=True)
            if "host_profile" in row:
                print(host_report(row["host_profile"]), flush=True)
    for path in plot(rows, out):
        print("plot:", path)
    return rows


if __name__ == "__main__":
    main()
