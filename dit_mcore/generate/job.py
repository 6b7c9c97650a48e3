"""The generation job: a checkpoint and a request in, files and ``index.json`` out, under any
generation layout (:mod:`dit_mcore.generate.layout`).

Everything about the model comes from the checkpoint (family, preset and overrides, objective and
its sampling defaults, the dataset's text encoder and latent decoder); the request says what to make.
Every check that needs no model runs before the process groups and the model are built.
"""

import contextlib
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from dit_mcore.errors import ConfigError
from dit_mcore.diffusion.samplers import SAMPLERS
from dit_mcore.generate import checkpoint as source
from dit_mcore.generate.cache import CachePolicy, StepCache, check_cache_layout, layer_flops, parse_cache
from dit_mcore.generate.grid import to_uint8
from dit_mcore.generate.items import Item, batches, item_seed, make_items, share
from dit_mcore.generate.imported import Imported
from dit_mcore.generate.layout import GenerateParallel, check_generation_layout, sampling_groups, st_attention_for
from dit_mcore.generate.pipefusion import PipeFusion, check_sampler, warmup_evaluations
from dit_mcore.generate.media import (dataset_decoder, save_gif, save_image, save_mp4, save_overview, slug, to_pixels,
                                      vae_config, vae_decoder, vae_folder)
from dit_mcore.generate.sampling import check_guidance, dataset_text_encoder, latent_shape, sample_items
from dit_mcore.models.registry import get_family
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.initialize import adopt_slurm_launch, initialize_distributed, on_any_rank, run_device
from dit_mcore.parallel.pipeline import ModelChunks, PipelinedForward
from dit_mcore.training.weights import WEIGHTS, find_checkpoint, load_weights, read_run, weights_model_config

log = logging.getLogger("dit_mcore.generate")

MAX_OVERVIEW = 256
"""Items the grid or strip of one call shows at most (the files hold every item)."""


@dataclass
class GenerateRequest:
    """What to generate, from which checkpoint, where to put it. Unset sampling settings take the run's."""

    checkpoint: Optional[str] = None
    """A run directory (its ``log.dir``), its ``checkpoints/`` folder or one ``step_*`` checkpoint."""
    diffusers: Optional[str] = None
    """Instead of a checkpoint: a diffusers ``DiTTransformer2DModel`` directory (DDPM objective)."""
    facebookresearch: Optional[str] = None
    """Instead of a checkpoint: a facebookresearch/DiT state dict file (DDPM objective)."""
    preset: Optional[str] = None
    """With ``facebookresearch``: the architecture's preset (default ``DiT-XL/2``)."""
    out: str = "generated"
    """Output folder: one file per item, ``grid.png`` / ``strip.png`` and ``index.json``."""
    step: Optional[int] = None
    """The checkpoint's step (default: the newest intact one)."""
    weights: str = "ema"
    """"ema" (the average the previews draw) or "model" (the trained weights)."""
    labels: Optional[list[str]] = None
    """Class labels (class-conditional models); ``["all"]``: every class."""
    prompts: Optional[list[str]] = None
    """Prompts (text-conditioned models)."""
    num_per_prompt: int = 1
    """Items per label or prompt, each with its own noise."""
    steps: Optional[int] = None
    """Sampler steps (default: the run's ``diffusion.sample_steps``)."""
    cfg_scale: Optional[float] = None
    """Guidance scale (default: the run's ``diffusion.cfg_scale``); 1: unguided."""
    sampler: Optional[str] = None
    """A sampler of the run's objective (``dit_mcore.diffusion.samplers.SAMPLERS``); default: its first."""
    seed: int = 0
    """Item i's noise comes from (seed, i): the same pictures whatever the batch size and layout."""
    batch_size: int = 16
    """Items per sampler call on one rank (per CFG half under CFG-parallel)."""
    frames: Optional[int] = None
    """Latent frames of a video model's clips (default: the run's ``data.video_frames`` for video data)."""
    height: Optional[int] = None
    """Latent height (default: the model's ``input_size``)."""
    width: Optional[int] = None
    """Latent width (default: the model's ``input_size``)."""
    dtype: Optional[str] = None
    """"fp32" or "bf16" (default: bf16 on a GPU for a run trained in bf16, else fp32)."""
    mp4: bool = True
    """Clips: an MP4 beside each GIF."""
    save_latents: bool = False
    """Also write ``latents.pt``: the sampled latents ``[items, ...]`` in item order (float32)."""
    cache: Optional[str] = None
    """Step caching (:mod:`dit_mcore.generate.cache`): ``fora:N``, ``teacache:T``, ``fbcache:T`` or
    ``static:PLAN.json``."""
    vae: Optional[str] = None
    """A diffusers VAE folder (or a pipeline folder holding ``vae/``) that decodes the latents to pixels.
    Default: the decoder the run's dataset recorded; with ``diffusers``, the ``vae/`` beside the
    transformer's folder when there is one (a ``DiTPipeline``'s layout)."""
    progress: bool = True


@dataclass
class Plan:
    """A request resolved against its checkpoint, before any model exists."""

    request: GenerateRequest
    parallel: GenerateParallel
    path: Path
    imported: Optional[Imported]
    run: object
    items: list
    shape: tuple
    steps: int
    cfg_scale: float
    sampler: str
    dtype: torch.dtype
    encode: Optional[object] = None
    """The dataset's text encoder (text models)."""
    cache: Optional[CachePolicy] = None
    vae: Optional[Path] = None
    """The diffusers VAE that decodes the latents (None: the dataset's decoder, if any)."""


def _vae(r: GenerateRequest, imported: Optional[Imported], model_config) -> Optional[Path]:
    """``--vae``, or the ``vae/`` of the pipeline a ``--diffusers`` transformer folder is part of; its
    latent channels checked against the model's."""
    if r.vae:
        folder = vae_folder(Path(r.vae))
        if folder is None:
            raise ConfigError(f"--vae {r.vae}: no diffusers VAE there; give a folder with its config.json (or a "
                              "pipeline folder holding vae/config.json)")
    elif imported is not None and imported.kind == "diffusers":
        folder = vae_folder(imported.path.parent / "vae")
        if folder is None:
            return None
    else:
        return None
    channels = vae_config(folder).get("latent_channels")
    if channels is not None and channels != model_config.in_channels:
        raise ConfigError(f"--vae {folder}: its latents have {channels} channels but the model's have "
                          f"{model_config.in_channels}; give the VAE the model was trained on")
    return folder


def _world_size() -> int:
    adopt_slurm_launch()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _check_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{os.getpid()}"  # (every rank probes at once)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out {out}: not a writable folder ({e.strerror or e}); choose another --out") from None


def plan(request: GenerateRequest, parallel: Optional[GenerateParallel] = None,
         world_size: Optional[int] = None) -> Plan:
    """Resolve and check ``request`` and its layout (default: one process per model replica, the
    ranks sharing the items) against its checkpoint: every error here is one line naming the
    argument and the fix, raised before any process group or model is built."""
    r, parallel = request, parallel or GenerateParallel()
    if r.num_per_prompt < 1 or r.batch_size < 1:
        raise ConfigError(f"--num-per-prompt ({r.num_per_prompt}) and --batch-size ({r.batch_size}) must be >= 1")
    if r.steps is not None and r.steps < 1:
        raise ConfigError(f"--steps {r.steps}: must be >= 1")
    sources = [k for k in ("checkpoint", "diffusers", "facebookresearch") if getattr(r, k)]
    if len(sources) != 1:
        raise ConfigError("give one of --checkpoint (a dit_mcore run), --diffusers or --facebookresearch "
                          f"(got {', '.join('--' + k for k in sources) or 'none'})")
    imported = None
    if r.checkpoint:
        path = find_checkpoint(r.checkpoint, r.step)
        run = read_run(path)
        if run.model.family == "stdit":
            run.model.st_attention = st_attention_for(parallel, run.model.st_attention)
        # sizes and conditioning only: no groups, no weights
        model_config = weights_model_config(run.model).build(ParallelConfig())
    else:
        if r.step is not None or r.weights != "ema":
            raise ConfigError("--step and --weights pick from a dit_mcore checkpoint; imported weights are one set")
        kind = sources[0]
        imported = Imported.describe(kind, getattr(r, kind), r.preset)
        imported.check_layout(parallel)
        path, run, model_config = imported.path, imported.run, imported.model_config
    if r.weights not in WEIGHTS:
        raise ConfigError(f"--weights {r.weights}: use one of {', '.join(WEIGHTS)}")
    if r.labels is not None and r.prompts is not None:
        raise ConfigError("give --labels or --prompts, not both")
    unconditional = not model_config.num_classes and not model_config.text_dim
    if r.labels is None and r.prompts is None and not unconditional:
        wants = "--prompts or --prompt-file" if model_config.text_dim else "--labels (e.g. --labels 0,3,7 or all)"
        raise ConfigError(f"nothing to generate: give {wants}")
    if r.labels is not None and not [str(x) for x in r.labels if str(x).strip()]:
        raise ConfigError("--labels: no label given; e.g. --labels 0,3,7 or all")
    if r.prompts is not None and not model_config.text_dim:
        raise ConfigError(f"--prompts: this model (family {run.model.family}) is conditioned on class labels "
                          f"0..{model_config.num_classes - 1}, not text; give --labels")
    if r.labels is not None and model_config.text_dim:
        raise ConfigError("--labels: this model is conditioned on text; give --prompts or --prompt-file")
    labels = r.labels
    if labels is not None:
        if not model_config.num_classes:
            raise ConfigError("--labels: this model is unconditional; it takes no labels (give --num-per-prompt N)")
        if [str(x) for x in labels] == ["all"]:
            labels = list(range(model_config.num_classes))
        try:
            labels = [int(x) for x in labels]
        except ValueError:
            raise ConfigError(f"--labels {','.join(map(str, labels))}: give integers (e.g. 0,3,7) or 'all'") from None
        bad = [y for y in labels if not 0 <= y < model_config.num_classes]
        if bad:
            raise ConfigError(f"--labels {bad[0]}: out of range; this model has classes 0..{model_config.num_classes - 1}")
    if r.prompts is not None and not [p for p in r.prompts if p.strip()]:
        raise ConfigError("--prompts: every prompt is empty")
    items = (make_items(labels=labels, prompts=r.prompts, num_per_prompt=r.num_per_prompt) if not unconditional
             else make_items(count=r.num_per_prompt))
    frames = r.frames
    if frames is None and run.data.name == "moving_digits" and not run.data.uses_energon:
        frames = run.data.video_frames
    shape = latent_shape(model_config, frames=frames, height=r.height, width=r.width)
    objective_name = run.diffusion.objective
    if objective_name not in SAMPLERS:
        raise ConfigError(f"the checkpoint's diffusion.objective={objective_name!r} has no sampler here; "
                          f"known: {', '.join(SAMPLERS)}")
    sampler = r.sampler or SAMPLERS[objective_name][0]
    if sampler not in SAMPLERS[objective_name]:
        raise ConfigError(f"--sampler {sampler}: the model was trained with the {objective_name!r} objective; "
                          f"use one of {', '.join(SAMPLERS[objective_name])}")
    steps = r.steps or run.diffusion.sample_steps
    objective = run.diffusion.build()
    if objective_name == "ddpm" and steps > objective.config.num_train_timesteps:
        raise ConfigError(f"--steps {steps}: a DDPM model samples at most its "
                          f"{objective.config.num_train_timesteps} training steps")
    cfg_scale = run.diffusion.cfg_scale if r.cfg_scale is None else r.cfg_scale
    if r.cfg_scale is None and unconditional:  # the run's guidance scale has nothing to guide by
        cfg_scale = 1.0
    check_guidance(model_config, cfg_scale)
    encode = None
    if model_config.text_dim:
        encode = dataset_text_encoder(run.data)
        if encode is None:
            where = run.data.path
            raise ConfigError(
                f"no text encoder for this model's prompts: the run's dataset {where} is not readable here (its "
                "prepare record names the encoder); copy it or point to it" if where and not Path(where).exists()
                else "no text encoder for this model's prompts: the run's dataset recorded none it can build here "
                     "(energon_data.prepare --text-encoder; built-in: moving_digits)")
        if model_config.num_classes and not model_config.use_cfg_embedding:
            raise ConfigError("this text model also takes class labels but has no null class (trained with "
                              "model.class_dropout_prob=0), so prompts alone cannot drive it")
    vae = _vae(r, imported, model_config)
    if vae is not None:
        log.info("decoding latents with the VAE in %s", vae)
    elif imported is not None and model_config.in_channels not in (1, 3):
        log.warning("no VAE for %d-channel latents: images show channel 0 in grey; pass --vae (a diffusers "
                    "AutoencoderKL folder, e.g. the pipeline's vae/)", model_config.in_channels)
    elif model_config.in_channels not in (1, 3) and not (run.data.path and Path(run.data.path).exists()):
        log.warning("no latent decoder for %d-channel latents (the run's dataset %s records it): images show "
                    "channel 0 in grey; pass --vae to decode them", model_config.in_channels,
                    run.data.path or "is built in and")
    world = world_size or _world_size()
    check_generation_layout(parallel, model_config, world, shape=shape, cfg_scale=cfg_scale)
    cache = None
    if r.cache:
        cache = parse_cache(r.cache, evaluations=sampler_evaluations(sampler, objective_name, steps),
                            depth=model_config.num_layers, sampler=sampler, steps=steps)
        check_cache_layout(parallel, cache)
    parallel = parallel.staged()
    if parallel.patches() > 1:
        check_sampler(sampler)
    on_gpu = torch.cuda.is_available()
    dtype_name = r.dtype or ("bf16" if on_gpu and run.trainer.bf16 else "fp32")
    if dtype_name not in ("fp32", "bf16"):
        raise ConfigError(f"--dtype {dtype_name}: use fp32 or bf16")
    _check_out(Path(r.out))
    return Plan(request=r, parallel=parallel, path=path, imported=imported, run=run, items=items, shape=shape,
                steps=steps, cfg_scale=cfg_scale, sampler=sampler, encode=encode, cache=cache, vae=vae,
                dtype=torch.bfloat16 if dtype_name == "bf16" else torch.float32)


def layout_name(p: GenerateParallel, world_size: int) -> str:
    """``"tp2 cp2(a2a) cfg2 items2"``-style summary of a generation layout (``"1 process"`` for none)."""
    parts = []
    if p.tensor_model_parallel_size > 1:
        parts.append(f"tp{p.tensor_model_parallel_size}" + ("+sp" if p.sequence_parallel else ""))
    if p.context_parallel_size > 1:
        parts.append(f"cp{p.context_parallel_size}({p.cp_comm_type})")
    if p.patches() > 1:
        parts.append(f"pipefusion{p.pipefusion}x{p.patches()}(warmup {p.pipefusion_warmup_steps})")
    elif p.pipeline_model_parallel_size > 1:
        vpp = p.virtual_pipeline_model_parallel_size
        parts.append(f"pp{p.pipeline_model_parallel_size}" + (f"x{vpp}" if vpp else ""))
    if p.cfg_parallel > 1:
        parts.append(f"cfg{p.cfg_parallel}")
    items = p.items_parallel_size(world_size)
    if items > 1:
        parts.append(f"items{items}")
    return " ".join(parts) or "1 process"


def _file_stem(item: Item) -> str:
    name = f"class{item.label}" if item.label is not None else slug(item.prompt) if item.prompt is not None else "sample"
    return f"{item.index:04d}_{name}"


def _write_item(item: Item, pixels: torch.Tensor, out: Path, mp4: bool) -> list[str]:
    stem = _file_stem(item)
    if pixels.dim() == 3:
        return [save_image(pixels, out / f"{stem}.png").name]
    files = [save_gif(pixels, out / f"{stem}.gif").name]
    if mp4:
        files.append(save_mp4(pixels, out / f"{stem}.mp4").name)
    return files


def _agree(problem: Optional[BaseException], device) -> None:
    """Raise on every rank when any rank failed: one rank's error would leave the others waiting in
    their next collective."""
    failed = on_any_rank(problem is not None, device)
    if problem is not None:
        raise problem
    if failed:
        raise ConfigError("another rank failed to load the model (its error names the cause)")


def sampler_evaluations(sampler: str, objective: str, steps: int) -> int:
    """Network calls of one sampler run (the progress bar's unit)."""
    if sampler == "heun":
        return 2 * steps - (1 if objective == "edm" else 0)
    return steps


def load_model(p: Plan, device) -> tuple:
    """``(chunks, model_config)``: this rank's part of the plan's model under its layout, its weights
    loaded (on every rank, or a one-line error raised on every rank)."""
    problem = None
    try:
        if p.imported is not None:
            model = ModelChunks([p.imported.load()]).to(device=device, dtype=p.dtype).eval()
            model_config = model.config
        else:
            model, model_config = source.build_model(weights_model_config(p.run.model), p.parallel,
                                                     dtype=p.dtype, device=device)
            load_weights(model, p.path, weights=p.request.weights, run=p.run, model_config=model_config)
    except ConfigError as e:
        problem = e
    _agree(problem, device)
    return model, model_config


def model_function(p: Plan, model, model_config):
    """The family's ``image_model_fn`` over the model's pipeline: what the samplers call."""
    return get_family(p.run.model.family).image_model_fn(PipelinedForward(model), model_config)


def decision_groups(groups) -> list:
    """The groups over which the ranks sampling the same items hold the rest of a batch: tensor and context
    parallel (tokens; under tensor parallel without sequence parallel each holds them all, which a ratio of sums
    does not mind) and the CFG pair (the other half)."""
    from megatron.core import parallel_state
    out = [g for g in (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group())
           if dist.get_world_size(g) > 1]
    return out + ([groups.cfg_group] if groups.cfg_group is not None else [])


def run_plan(p: Plan) -> dict:
    """Build the model for the layout, sample this rank's items and write them; returns the summary
    (on every rank). Process groups must be initialised (:func:`generate` does it)."""
    r = p.request
    world = dist.get_world_size()
    paths = [None] * world
    dist.all_gather_object(paths, str(p.path))  # each rank resolved "the newest" on its own
    if len(set(paths)) > 1:
        raise ConfigError(f"--checkpoint: the ranks found different newest checkpoints ({', '.join(sorted(set(paths)))}; "
                          "the run is still saving); pass --step")
    groups = sampling_groups(p.parallel)
    device = run_device()
    model, model_config = load_model(p, device)
    objective = p.run.diffusion.build()
    model_fn = model_function(p, model, model_config)
    encode = p.encode
    decoder = None
    if groups.writes:
        decoder = vae_decoder(p.vae) if p.vae is not None else dataset_decoder(p.run.data.path)
    layout = layout_name(p.parallel, world)
    mine = batches(share(p.items, groups.items_rank, groups.items_size), r.batch_size)
    out = Path(r.out)

    from tqdm import tqdm
    evaluations = sampler_evaluations(p.sampler, objective.name, p.steps)
    bar = tqdm(total=len(mine) * evaluations, unit="eval",
               disable=not (r.progress and dist.get_rank() == 0), desc="generate", leave=False)

    step_cache = None
    if p.cache is not None:
        step_cache = StepCache(p.cache, model, evaluations, groups=decision_groups(groups))
    calls = [0]

    def counted(*args, **kwargs):
        if step_cache is not None:
            step_cache.evaluation(calls[0])
        calls[0] += 1
        out_ = model_fn(*args, **kwargs)
        bar.update(1)
        return out_

    pipefusion = None
    if p.parallel.patches() > 1:
        warmup = warmup_evaluations(p.steps, evaluations, p.parallel.pipefusion_warmup_steps)
        pipefusion = PipeFusion(model, model_config, patches=p.parallel.patches(), warmup=warmup,
                                on_evaluation=lambda: bar.update(1), cache=step_cache)
    index, overview, latent_rows, start, flops_saved, sampling = [], [], [], time.perf_counter(), 0.0, 0.0
    for batch in mine:
        began, calls[0] = time.perf_counter(), 0
        with step_cache.installed() if step_cache is not None else contextlib.nullcontext():
            skipped = step_cache.stats.skipped if step_cache is not None else 0
            if step_cache is not None:
                step_cache.start()
            latents = sample_items(counted, model_config, objective, batch, shape=p.shape, seed=r.seed, steps=p.steps,
                                   cfg_scale=p.cfg_scale, sampler=p.sampler, encode=encode, device=device,
                                   cfg_group=groups.cfg_group, pipefusion=pipefusion)
            if latents.is_cuda:
                torch.cuda.synchronize()
        sampling += time.perf_counter() - began
        if step_cache is not None:
            flops_saved += (step_cache.stats.skipped - skipped) * layer_flops(
                model_config, p.shape, [it.prompt for it in batch], encode, guided=p.cfg_scale != 1.0)
        seconds = (time.perf_counter() - began) / len(batch)
        if not groups.writes:
            continue
        pixels = to_pixels(latents, decoder)
        for item, px in zip(batch, pixels):
            files = _write_item(item, px, out, r.mp4)
            condition = ({"label": item.label} if item.label is not None else
                         {"prompt": item.prompt} if item.prompt is not None else {})
            entry = {"index": item.index, **condition,
                     "seed": r.seed, "noise_seed": item_seed(r.seed, item.index), "file": files[0], "files": files,
                     "steps": p.steps, "sampler": p.sampler, "cfg_scale": p.cfg_scale, "weights": r.weights,
                     "checkpoint": str(p.path), "layout": layout, "seconds": round(seconds, 4),
                     **({"cache": r.cache} if r.cache else {})}
            index.append(entry)
            if len(overview) < MAX_OVERVIEW:
                overview.append((item.index, to_uint8(px)))
        if r.save_latents:
            latent_rows.extend(zip((it.index for it in batch), latents.float().cpu()))
    bar.close()
    dist.barrier()
    seconds = time.perf_counter() - start
    gathered = [None] * world if dist.get_rank() == 0 else None  # (to rank 0 only: pixels as uint8)
    dist.gather_object((index, overview, latent_rows) if groups.writes else ([], [], []), gathered, dst=0)
    summary = {"items": len(p.items), "seconds": round(seconds, 3), "items_per_s": round(len(p.items) / seconds, 4),
               "layout": layout, "world_size": world, "out": str(out), "sampling_seconds": round(sampling, 4)}
    if step_cache is not None:
        from megatron.core import parallel_state
        counts = torch.tensor([step_cache.stats.skipped, step_cache.stats.layer_evaluations, flops_saved],
                              dtype=torch.float64, device=device)
        dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())  # each stage its layers
        skipped, layer_evaluations, flops_saved = counts.tolist()
        step_cache.stats.skipped, step_cache.stats.layer_evaluations = round(skipped, 6), round(layer_evaluations, 6)
        # rank 0's items (items-parallel); FLOPs of the whole model replica, both guidance halves
        summary["cache"] = {"policy": r.cache, **step_cache.stats.as_dict(), "flops_saved": flops_saved}
    if dist.get_rank() == 0:
        index = sorted((e for part, _, _ in gathered for e in part), key=lambda e: e["index"])
        pictures = [px for _, px in sorted((x for _, part, _ in gathered for x in part), key=lambda x: x[0])]
        pictures = [px.float() / 127.5 - 1 for px in pictures[:MAX_OVERVIEW]]
        if len(p.items) > MAX_OVERVIEW:
            log.warning("the overview shows the first %d of %d items", MAX_OVERVIEW, len(p.items))
        if r.save_latents:
            rows = sorted((x for _, _, part in gathered for x in part), key=lambda x: x[0])
            torch.save(torch.stack([x for _, x in rows]), out / "latents.pt")
        (out / "index.json").write_text(json.dumps(index, indent=1))
        stacked = torch.stack(pictures)
        name = "strip.png" if stacked.dim() == 5 else "grid.png"
        save_overview(stacked, out / name, per_row=r.num_per_prompt if r.num_per_prompt > 1 else min(len(pictures), 8),
                      upscale=max(1, 128 // max(stacked.shape[-1], stacked.shape[-2])))
        print(f"generated {summary['items']} items in {summary['seconds']:.1f} s ({summary['items_per_s']:.3g} items/s) "
              f"on {layout}{f' ({world} processes)' if world > 1 else ''} -> {out}", flush=True)
        if step_cache is not None:
            c = summary["cache"]
            print(f"cache {r.cache}: {c['skipped']:g} of {c['layer_evaluations']:g} layer evaluations served from the cache "
                  f"({c['skipped_fraction']:.1%}; {c['flops_saved'] / 1e9:.3g} GFLOPs saved; rank 0's items)", flush=True)
    return summary


def generate(request: GenerateRequest, parallel: Optional[GenerateParallel] = None) -> dict:
    """Plan, initialise the layout's process groups, run, and release the groups this job made."""
    from dit_mcore.parallel.initialize import release_model_parallel_groups
    p = plan(request, parallel)
    initialize_distributed(p.parallel, seed=0)
    try:
        return run_plan(p)
    finally:
        release_model_parallel_groups()


def layout_from_overrides(overrides: list[str]) -> GenerateParallel:
    """The layout of ``parallel.name=value`` overrides (one line per unknown name)."""
    import ast

    from dit_mcore.training.validate import did_you_mean
    names = {f.name: f for f in dataclasses.fields(GenerateParallel)}
    values = {}
    for arg in overrides:
        key, sep, raw = arg.partition("=")
        section, _, name = key.partition(".")
        if not sep or section != "parallel":
            raise ConfigError(f"{arg}: generation takes parallel.<field>=<value> overrides (model settings come "
                              "from the checkpoint); e.g. parallel.cfg_parallel=2")
        if name not in names:
            raise ConfigError(f"parallel.{name}: unknown field{did_you_mean(name, names)}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        default = getattr(GenerateParallel(), name)
        if isinstance(default, (bool, int)) and type(value) is not type(default):
            raise ConfigError(f"parallel.{name}={raw}: give {'True or False' if isinstance(default, bool) else 'an integer'}")
        values[name] = value
    return GenerateParallel(**values)
