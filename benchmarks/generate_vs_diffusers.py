"""Class-conditional sampling against diffusers' ``DiTPipeline``, side by side in one run: the same
``DiTTransformer2DModel`` weights (random, seeded), noise, labels, DDIM steps, guidance and precision;
images per second of each and their ratio (ours / diffusers').

diffusers runs its pipeline (``DiTPipeline`` with its ``DDIMScheduler``; the VAE is a stub so that both
time the transformer and the sampler, not the shared decoder). dit-mcore samples the weights as
``python -m dit_mcore.generate --diffusers`` does: converted by ``dit_mcore.models.dit.interop``, DDIM from
``dit_mcore.diffusion`` with the guidance pair batched in one call. ``--compile``: diffusers'
transformer through ``torch.compile`` (the usual way), ours layer by layer (``compile_layers``, as the
trainer compiles). The two latents are compared too (relative difference printed; fp32 on CPU: 1e-5).

    python benchmarks/generate_vs_diffusers.py                              # DiT-XL/2, 256 px, bf16 on a GPU
    python benchmarks/generate_vs_diffusers.py --size 512 --compile
    python benchmarks/generate_vs_diffusers.py --preset DiT-S/2 --size 128 --steps 4 --batch 2   # CPU smoke
    python benchmarks/generate_vs_diffusers.py --size 512 --compile --cache fora:2,fora:3   # + step caching

The issue's goal on one H100/H200: at least 1.3x at 256 and 512 px, both compiled. ``--cache``: our sampler
also with each step-caching policy (``python -m dit_mcore.generate --cache``), its wall-time speed-up over our
uncached run and the share of layer evaluations it served from the cache (issue #37's GPU row; FORA's schedule
does not depend on the weights, so random ones time it as a trained model's; TeaCache's and First-Block-Cache's
decisions need trained weights: ``benchmarks/cache_tradeoff.py``). Writes
``benchmarks/results/generate_vs_diffusers_<device>.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.results_io import device_name, write_result  # noqa: E402


class _StubVAE(torch.nn.Module):
    """``DiTPipeline``'s VAE, decoding to the latents themselves (both sides skip the same decoder)."""

    def __init__(self, device, dtype):
        super().__init__()
        self.config = types.SimpleNamespace(scaling_factor=1.0)
        self.device, self.dtype = torch.device(device), dtype

    def decode(self, z):
        self.latents = z
        return types.SimpleNamespace(sample=z)


def _timed(fn, repeats: int, device) -> tuple[float, object]:
    out = fn()  # warm-up (compiles)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats, out


def _time_cached(policy: str, model, objective, model_fn, noise, labels, args, device) -> dict:
    """Our sampler of the same noise with the step-caching ``policy`` (as ``dit_mcore.generate --cache``): seconds
    per call and the share of layer evaluations served from the cache."""
    from dit_mcore.diffusion.samplers import sample
    from dit_mcore.generate.cache import StepCache, parse_cache
    from dit_mcore.generate.job import sampler_evaluations

    evaluations = sampler_evaluations("ddim", objective.name, args.steps)
    cache = StepCache(parse_cache(policy, evaluations=evaluations, depth=model.config.num_layers), model, evaluations)
    calls = [0]

    def counted(*a, **k):
        cache.evaluation(calls[0])
        calls[0] += 1
        return model_fn(*a, **k)

    @torch.no_grad()
    def run():
        calls[0] = 0
        cache.start()
        with cache.installed():
            return sample(objective, counted, noise, args.steps, sampler="ddim", labels=labels, null_label=1000,
                          cfg_scale=args.cfg_scale)

    seconds, _ = _timed(run, args.repeats, device)
    stats = cache.stats.as_dict()
    return {"seconds_per_call": seconds, "skipped_fraction": stats["skipped_fraction"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="DiT-XL/2")
    ap.add_argument("--size", type=int, default=256, help="image side in pixels (latents: size / 8)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cfg-scale", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=8, help="images per call")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: bf16 on a GPU, fp32 on CPU")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default="", help="step-caching policies to time too, comma-separated (fora:2,fora:3)")
    ap.add_argument("--out", help="result JSON (default: benchmarks/results/generate_vs_diffusers_<device>.json)")
    args = ap.parse_args()

    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    from dit_mcore.diffusion import build_objective
    from dit_mcore.diffusion.samplers import sample
    from dit_mcore.models.adapter import image_model_fn
    from dit_mcore.models.dit.config import preset
    from dit_mcore.models.dit.interop import load_diffusers
    from dit_mcore.parallel.initialize import whole_model_world

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    latent = args.size // 8
    arch = preset(args.preset)
    heads = arch.num_attention_heads
    torch.manual_seed(0)
    theirs = DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=arch.hidden_size // heads,
                                   in_channels=4, out_channels=8, num_layers=arch.num_layers, sample_size=latent,
                                   patch_size=arch.patch_size, num_embeds_ada_norm=1000, norm_eps=1e-6)
    for p in theirs.parameters():  # adaLN-Zero starts at zero: random weights so the model does something
        torch.nn.init.normal_(p, std=0.02)
    for block in theirs.transformer_blocks[1:]:  # one timestep/label embedder, as DiT's (diffusers keeps a copy per block)
        block.norm1.emb.load_state_dict(theirs.transformer_blocks[0].norm1.emb.state_dict())
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        whole_model_world()
        ours = load_diffusers(folder)
    theirs, ours = theirs.to(device, dtype).eval(), ours.to(device, dtype).eval()

    labels = torch.arange(args.batch) * 97 % 1000
    noise = torch.randn(args.batch, 4, latent, latent, generator=torch.Generator().manual_seed(1))
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False)
    vae = _StubVAE(device, dtype)
    pipe = DiTPipeline(transformer=theirs, vae=vae, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    if args.compile:
        pipe.transformer = torch.compile(pipe.transformer)
        ours.compile_layers()
    objective, model_fn = build_objective("ddpm"), image_model_fn(ours, ours.config)

    @torch.no_grad()
    def run_theirs():
        pipe(class_labels=labels.tolist(), guidance_scale=args.cfg_scale, num_inference_steps=args.steps,
             generator=torch.Generator().manual_seed(1), output_type="pt")
        return vae.latents

    @torch.no_grad()
    def run_ours():
        return sample(objective, model_fn, noise.to(device, dtype), args.steps, sampler="ddim",
                      labels=labels.to(device), null_label=1000, cfg_scale=args.cfg_scale)

    seconds, results = {}, {}
    for name, fn in (("diffusers", run_theirs), ("dit_mcore", run_ours)):  # one after the other, same process
        seconds[name], results[name] = _timed(fn, args.repeats, device)
    cached = {}
    for policy in filter(None, args.cache.split(",")):
        cached[policy] = _time_cached(policy, ours, objective, model_fn, noise.to(device, dtype), labels.to(device),
                                      args, device)
        seconds[f"dit_mcore {policy}"] = cached[policy]["seconds_per_call"]
    want, got = results["diffusers"].float(), results["dit_mcore"].float()
    rel = ((got - want).norm() / want.norm()).item()
    images_s = {k: args.batch / v for k, v in seconds.items()}
    ratio = images_s["dit_mcore"] / images_s["diffusers"]
    print(f"{args.preset} {args.size}px, batch {args.batch}, {args.steps} DDIM steps, guidance {args.cfg_scale}, "
          f"{str(dtype).split('.')[-1]}{' compiled' if args.compile else ''} on {device_name()}")
    for name in seconds:
        print(f"  {name:>9}: {seconds[name]:.3f} s per call, {images_s[name]:.2f} images/s")
    print(f"  ratio (dit_mcore / diffusers): {ratio:.2f}x; latents' relative difference {rel:.2e}")
    for policy, row in cached.items():
        row["speedup"] = seconds["dit_mcore"] / row["seconds_per_call"]
        print(f"  cache {policy}: {row['speedup']:.2f}x our uncached wall time, {row['skipped_fraction']:.0%} of "
              "layer evaluations served from the cache")
    result = {"device": device_name(), "torch": torch.__version__, "preset": args.preset, "size": args.size,
              "batch": args.batch, "steps": args.steps, "cfg_scale": args.cfg_scale, "dtype": str(dtype),
              "compiled": args.compile, "seconds_per_call": seconds, "images_per_s": images_s, "ratio": ratio,
              "latents_rel_diff": rel, "cache": cached, "command": " ".join(sys.argv)}
    print("wrote", write_result("generate_vs_diffusers", result, args.out))


if __name__ == "__main__":
    main()
