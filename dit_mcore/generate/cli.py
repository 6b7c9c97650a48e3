"""``python -m dit_mcore.generate``: pictures and clips from a trained checkpoint.

    python -m dit_mcore.generate --checkpoint runs/digits --labels 0,3,7 --num-per-prompt 4 --out out/digits
    python -m dit_mcore.generate --checkpoint runs/t2v_digits --prompts "a 3 moving left" --out out/t2v
    python -m dit_mcore.generate --diffusers DiT-XL-2-256/transformer --labels 207,360 --out out/imagenet
    torchrun --nproc-per-node 4 -m dit_mcore.generate --checkpoint runs/x --labels all \\
        parallel.cfg_parallel=2 parallel.context_parallel_size=2 parallel.cp_comm_type=a2a

Model settings come from the checkpoint; layouts are ``parallel.<field>=<value>`` overrides with
training's names plus ``parallel.cfg_parallel``. Bad input exits with status 2 and one line naming the
argument and the fix.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional

from dit_mcore.errors import ConfigError
from dit_mcore.generate.job import GenerateRequest, generate, layout_from_overrides
from dit_mcore.generate.layout import GenerateParallel


def _split(values: Optional[list]) -> Optional[list]:
    """``--labels 0,3 7`` -> ``["0", "3", "7"]``."""
    if values is None:
        return None
    return [v for value in values for v in value.split(",") if v]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dit_mcore.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Layouts: parallel.tensor_model_parallel_size, context_parallel_size, "
                                       "cp_comm_type (p2p|a2a|all_gather|a2a+p2p), pipeline_model_parallel_size, "
                                       "cfg_parallel (1|2), ...; the ranks left over share the items.")
    p.add_argument("--checkpoint", help="a run directory (log.dir), its checkpoints/ or one step_* folder")
    p.add_argument("--diffusers", help="instead: a diffusers DiTTransformer2DModel directory (sampled with DDPM/DDIM)")
    p.add_argument("--facebookresearch", help="instead: a facebookresearch/DiT state dict (.pt; sampled with DDPM/DDIM)")
    p.add_argument("--preset", help="with --facebookresearch: the architecture (default DiT-XL/2)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest intact one)")
    p.add_argument("--weights", default="ema", help="ema (default: the average previews draw) or model")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--labels", nargs="+", help="class labels, e.g. 0,3,7 or all (class-conditional models)")
    what.add_argument("--prompts", nargs="+", help="prompts, each quoted (text-conditioned models)")
    what.add_argument("--prompt-file", help="a text file with one prompt per line")
    p.add_argument("--num-per-prompt", type=int, default=1, help="items per label or prompt (default 1)")
    p.add_argument("--steps", type=int, help="sampler steps (default: the run's diffusion.sample_steps)")
    p.add_argument("--cfg-scale", type=float, help="guidance scale (default: the run's diffusion.cfg_scale)")
    p.add_argument("--sampler", help="euler|heun for flow (default euler), heun|euler for edm (default heun), "
                                     "ddim|ddpm for ddpm (default ddim)")
    p.add_argument("--seed", type=int, default=0, help="item i's noise comes from (seed, i) (default 0)")
    p.add_argument("--batch-size", type=int, default=16, help="items per sampler call on one rank (default 16)")
    p.add_argument("--frames", type=int, help="latent frames of a video model's clips")
    p.add_argument("--height", type=int, help="latent height (default: the model's input_size)")
    p.add_argument("--width", type=int, help="latent width (default: the model's input_size)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="default: bf16 on a GPU for a bf16 run, else fp32")
    p.add_argument("--no-mp4", action="store_true", help="clips as GIFs only")
    p.add_argument("--save-latents", action="store_true", help="also write latents.pt (the latents in item order)")
    p.add_argument("--cache", help="step caching: fora:N (attention/MLP outputs reused between every Nth evaluation), "
                                   "teacache:T, fbcache:T (skip the layer stack while the first layer's input / "
                                   "residual changes less than T) or static:PLAN.json (from the redundancy analysis)")
    p.add_argument("--vae", help="a diffusers VAE folder (or a pipeline folder with vae/) to decode latents with "
                                 "(default: the run's dataset's decoder; with --diffusers, the pipeline's vae/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default="generated", help="output folder (default: generated)")
    p.add_argument("overrides", nargs="*", metavar="parallel.FIELD=VALUE", help="the generation layout")
    return p


def read_prompt_file(name: str) -> list[str]:
    """``--prompt-file``: one prompt per non-empty line (one line naming the argument if there is none)."""
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"--prompt-file {path}: no such file; give a text file with one prompt per line")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompt-file {path}: holds no prompt (one per line)")
    return prompts


def request_from_args(argv: Optional[list] = None) -> tuple[GenerateRequest, GenerateParallel]:
    args = parser().parse_args(argv)
    prompts = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompts
    request = GenerateRequest(
        checkpoint=args.checkpoint, diffusers=args.diffusers, facebookresearch=args.facebookresearch,
        preset=args.preset, out=args.out, step=args.step, weights=args.weights, labels=_split(args.labels),
        prompts=prompts, num_per_prompt=args.num_per_prompt, steps=args.steps, cfg_scale=args.cfg_scale,
        sampler=args.sampler, seed=args.seed, batch_size=args.batch_size, frames=args.frames, height=args.height,
        width=args.width, dtype=args.dtype, mp4=not args.no_mp4, save_latents=args.save_latents, cache=args.cache, vae=args.vae,
        progress=not args.no_progress)
    return request, layout_from_overrides(args.overrides)


def main(argv: Optional[list] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from dit_mcore.parallel.initialize import destroy_distributed
    try:
        generate(*request_from_args(argv))
    except ConfigError as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    return 0
