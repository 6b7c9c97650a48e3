"""Training-step throughput: our DiT vs diffusers' ``DiTTransformer2DModel`` on the same weights.

Both models get the same architecture and weights (ours is exported to diffusers' format and loaded
back by diffusers), the same batch, precision and optimizer (torch AdamW, foreach), and the same
rectified-flow loss on the prediction channels. Steps are interleaved in one process (ours, theirs,
ours, ...) so machine noise hits both alike; the medians give images/s and the ratio.

    python benchmarks/train_step.py                                   # CPU: DiT-S/2, 32x32x4, batch 8, fp32
    python benchmarks/train_step.py --preset DiT-XL/2 --batch 32 --dtype bf16   # one GPU
    python benchmarks/train_step.py --preset DiT-XL/2 --batch 32 --dtype bf16 --compile --profile

``--compile`` compiles each transformer layer of *both* models (regional ``torch.compile``, as
torchtitan does), so the ratio stays like for like; ``--profile`` adds each model's top GPU/CPU
kernels over a few steps (what bounds the step) to the printout and the JSON.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernel_profile import profile_steps, report, sync_device  # noqa: E402  (benchmarks/ is the script folder)
from results_io import device_name, write_result  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_pair(preset_name: str, device, dtype):
    """Our model and diffusers' with identical weights."""
    from diffusers import DiTTransformer2DModel

    from dit_mcore.models.dit.config import preset
    from dit_mcore.convert import export_diffusers, load_diffusers
    from dit_mcore.models.dit import build_model
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.parallel.initialize import initialize_distributed

    initialize_distributed(ParallelConfig(), seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        export_diffusers(build_model(preset(preset_name, timestep_freq_shift=1.0)), tmp)
        ours = load_diffusers(tmp)
        theirs = DiTTransformer2DModel.from_pretrained(tmp, local_files_only=True)
    return ours.to(device=device, dtype=dtype).train(), theirs.to(device=device, dtype=dtype).train()


def make_steps(ours, theirs, x0, t, y):
    """One training step per model: forward, flow loss on the first C output channels, backward, AdamW."""
    from dit_mcore.models.adapter import image_forward

    cfg = ours.config
    noise = torch.randn_like(x0)
    tt = (t / 1000.0).view(-1, 1, 1, 1).to(x0.dtype)
    xt, target = (1 - tt) * x0 + tt * noise, noise - x0
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4, foreach=True)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4, foreach=True)

    def ours_step():
        pred = image_forward(ours, cfg, xt, t, y)
        loss = (pred.float() - target.float()).square().mean()
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def theirs_step():
        out = theirs(xt, timestep=t, class_labels=y).sample[:, : cfg.in_channels]
        loss = (out.float() - target.float()).square().mean()
        loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)

    return ours_step, theirs_step


def compile_layers(ours, theirs) -> None:
    """Regional compile: every transformer layer of both models, in place (ours through its own
    ``compile_layers``, what ``model.compile=True`` runs)."""
    ours.compile_layers()
    for block in theirs.transformer_blocks:
        block.compile()


def timed(step, n: int, device) -> float:
    sync_device(device)
    start = time.perf_counter()
    for _ in range(n):
        step()
    sync_device(device)
    return (time.perf_counter() - start) / n


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="DiT-S/2")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=32, help="latent side (32 = 256px images)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median taken)")
    p.add_argument("--compile", action="store_true", help="compile each layer of both models")
    p.add_argument("--profile", action="store_true", help="report each model's top kernels")
    p.add_argument("--out", default=None, help="JSON result path (default: benchmarks/results/train_step_<device>.json)")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    ours, theirs = build_pair(args.preset, device, dtype)
    cfg = ours.config
    x0 = torch.randn(args.batch, cfg.in_channels, args.size, args.size, device=device, dtype=dtype)
    t = torch.randint(0, 1000, (args.batch,), device=device).float()
    y = torch.randint(0, cfg.num_classes, (args.batch,), device=device)
    if args.compile:
        compile_layers(ours, theirs)
    ours_step, theirs_step = make_steps(ours, theirs, x0, t, y)
    for _ in range(args.warmup):
        ours_step()
        theirs_step()
    times = {"ours": [], "diffusers": []}
    for _ in range(args.rounds):
        times["ours"].append(timed(ours_step, args.steps, device))
        times["diffusers"].append(timed(theirs_step, args.steps, device))
    med = {k: statistics.median(v) for k, v in times.items()}
    ips = {k: args.batch / v for k, v in med.items()}
    name = device_name()
    result = {
        "device": name, "command": "python benchmarks/train_step.py " + " ".join(argv or sys.argv[1:]),
        "preset": args.preset, "batch": args.batch, "latent": [cfg.in_channels, args.size, args.size],
        "dtype": args.dtype, "compile": args.compile, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "images_per_s": ips, "step_s_median": med, "step_s_rounds": times,
        "ratio_ours_over_diffusers": ips["ours"] / ips["diffusers"],
    }
    if args.profile:
        result["profile"] = {who: profile_steps(lambda n, step=step: [step() for _ in range(n)], device)
                             for who, step in (("ours", ours_step), ("diffusers", theirs_step))}
        for who, prof in result["profile"].items():
            print(report(f"profile, {who}", prof))
    print(f"{args.preset} batch {args.batch} {args.size}x{args.size} {args.dtype}"
          f"{' compiled' if args.compile else ''} on {name}: "
          f"ours {ips['ours']:.1f} img/s, diffusers {ips['diffusers']:.1f} img/s, "
          f"ratio {result['ratio_ours_over_diffusers']:.2f}x")
    write_result("train_step", result, args.out)
    return result


if __name__ == "__main__":
    main()
