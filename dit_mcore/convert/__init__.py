"""Weights in and out in the formats others use, in a plain interpreter.

- The interop functions of :mod:`dit_mcore.models.dit.interop` (``load_diffusers``, ``export_diffusers``,
  ``load_facebookresearch``, ``export_facebookresearch``), each first setting up the single-process
  megatron world they need (TP = PP = 1: :func:`dit_mcore.parallel.initialize.whole_model_world`).
- :func:`export_checkpoint`: a trained run's checkpoint (any training layout) as a diffusers
  ``DiTTransformer2DModel`` folder, a facebookresearch/DiT state dict, or one safetensors file of our
  own tensors (any family); from the command line,
  ``python -m dit_mcore.convert runs/digits exported/digits --to diffusers``.

    from dit_mcore.convert import export_diffusers, load_diffusers
    model = load_diffusers("DiT-XL-2-256/transformer")   # a diffusers DiTTransformer2DModel folder
    export_diffusers(model, "out/transformer")
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Optional

import torch

from dit_mcore.errors import ConfigError
from dit_mcore.models.dit import interop
from dit_mcore.parallel.initialize import whole_model_world
from dit_mcore.training.init_from import import_weights

log = logging.getLogger(__name__)

FORMATS = ("diffusers", "facebookresearch", "safetensors")


def _in_whole_model_world(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        whole_model_world()
        return fn(*args, **kwargs)
    return call


load_diffusers = _in_whole_model_world(interop.load_diffusers)
export_diffusers = _in_whole_model_world(interop.export_diffusers)
load_facebookresearch = _in_whole_model_world(interop.load_facebookresearch)
export_facebookresearch = _in_whole_model_world(interop.export_facebookresearch)


def export_checkpoint(checkpoint: str, out: str, *, to: str = "diffusers", step: Optional[int] = None,
                      weights: str = "ema") -> Path:
    """Write a trained run's checkpoint (a run directory, its ``checkpoints/`` or one ``step_*`` folder;
    ``step``: that step, default the newest intact one) as ``to``: a diffusers ``DiTTransformer2DModel``
    folder at ``out``, ``out/dit.pt`` holding a facebookresearch/DiT state dict (both: the adaLN-Zero DiT),
    or ``out/model.safetensors`` holding the whole model under our own names (any family; the run's
    model section beside it, in ``dit_mcore_source.json``). ``weights``: "ema"
    (the average the previews draw from) or "model" (the trained weights). The checkpoint is resharded
    into one whole model whatever layout wrote it. Returns what was written."""
    from dit_mcore.generate.checkpoint import build_model
    from dit_mcore.training.weights import find_checkpoint, load_weights, read_run, weights_model_config
    from dit_mcore.parallel.config import ParallelConfig
    if to not in FORMATS:
        raise ConfigError(f"--to {to!r}: use one of {', '.join(FORMATS)}")
    path = find_checkpoint(checkpoint, step)
    run = read_run(path)
    if run.model.family != "dit" and to != "safetensors":
        raise ConfigError(f"--checkpoint {path}: model.family={run.model.family} has no {to} format (only the "
                          "adaLN-Zero DiT, model.family=dit, has one); sample it with python -m dit_mcore.generate, or export --to safetensors")
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"--out {out_dir}: not empty; give a new folder (nothing is overwritten)")
    whole_model_world()
    chunks, config = build_model(weights_model_config(run.model), ParallelConfig(), dtype=torch.float32, device="cpu")
    load_weights(chunks, path, weights=weights, run=run, model_config=config)
    model = chunks[0]
    if to == "diffusers":
        interop.export_diffusers(model, str(out_dir))
        written = out_dir
    elif to == "safetensors":
        from safetensors.torch import save_file
        tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()
                   if torch.is_tensor(t) and not name.endswith("._extra_state")}
        out_dir.mkdir(parents=True, exist_ok=True)
        written = out_dir / "model.safetensors"
        save_file(tensors, str(written), metadata={"format": "pt", "family": run.model.family})
    else:
        state = interop.export_facebookresearch(model)  # (refuses before anything is written)
        out_dir.mkdir(parents=True, exist_ok=True)
        written = out_dir / "dit.pt"
        torch.save(state, written)
    (out_dir / "dit_mcore_source.json").write_text(json.dumps(
        {"checkpoint": str(path), "weights": weights, "family": run.model.family, "preset": run.model.preset,
         "objective": run.diffusion.objective, "model": run.to_dict()["model"],
         "diffusion": run.to_dict()["diffusion"]}, indent=1, default=str))
    log.info("wrote %s (%s weights of %s) as %s", written, weights, path, to)
    if run.diffusion.objective != "ddpm" and to != "safetensors":
        log.warning("the run trained with diffusion.objective=%s: the exported weights are ours, but "
                    "samplers built for DDPM noise prediction (diffusers' DiTPipeline) will not sample it as "
                    "trained; sample it with python -m dit_mcore.generate", run.diffusion.objective)
    return written


__all__ = ["FORMATS", "export_checkpoint", "export_diffusers", "export_facebookresearch", "import_weights",
           "load_diffusers", "load_facebookresearch"]
