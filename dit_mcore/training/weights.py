"""A checkpoint's weights without its optimizer: find a checkpoint from what a user names, read the run it
records, load its EMA or trained weights into this rank's chunks under any layout (megatron's
dist_checkpointing reshards), and write a whole model's weights as such a checkpoint (weights imported
from another library, :mod:`dit_mcore.training.init_from`). Generation, conversion and a run's initial
weights (``trainer.init_from``) all read checkpoints through here.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Optional

from megatron.core import dist_checkpointing

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.pipeline import ModelChunks
from dit_mcore.training import checkpoint as ckpt
from dit_mcore.training.config import ModelConfig, RunConfig

log = logging.getLogger(__name__)

WEIGHTS = ("ema", "model")
"""Which weights of a checkpoint: the EMA average (what previews draw from) or the trained weights."""


def _listing(path: Path, limit: int = 8) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    return ", ".join(names[:limit]) + (f" … ({len(names)} entries)" if len(names) > limit else "") or "nothing"


def find_checkpoint(path: str | Path, step: Optional[int] = None, flag: str = "--checkpoint") -> Path:
    """The checkpoint ``path`` names (``flag``: the argument it came from, for the messages): ``path`` is a run directory (holding ``checkpoints/``), its
    ``checkpoints/`` folder, or one ``step_XXXXXXXX`` checkpoint; ``step`` picks one (default: the
    newest intact one). Errors name what is there instead."""
    path = Path(path)
    if not path.exists():
        parent = path.parent if path.parent.exists() else None
        raise ConfigError(f"{flag} {path}: no such directory"
                          + (f"; {parent} holds {_listing(parent)}" if parent else "")
                          + "; give a run directory (e.g. runs/digits), its checkpoints/ or one step_* folder")
    if path.name.startswith("step_") and ((path / "metadata.json").exists() or (path / ckpt.MANIFEST).exists()):
        if step is not None and int(path.name.removeprefix("step_")) != step:
            raise ConfigError(f"--step {step}: --checkpoint names the checkpoint {path.name} itself; drop --step "
                              "or give the run directory")
        problem = ckpt.checkpoint_problem(path)
        if problem:
            raise ConfigError(f"{flag} {path}: not usable, {problem}; pick another step")
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    if not steps:
        raise ConfigError(f"{flag} {path}: no checkpoint there (it holds {_listing(path)}); give a run "
                          "directory with checkpoints/ (a training run's log.dir), or one step_* folder")
    if step is not None:
        wanted = root / f"step_{step:08d}"
        if wanted not in steps:
            have = ", ".join(str(int(p.name.removeprefix("step_"))) for p in steps)
            raise ConfigError(f"--step {step}: no such checkpoint in {root}; it has steps {have}")
        problem = ckpt.checkpoint_problem(wanted)
        if problem:
            raise ConfigError(f"--step {step}: checkpoint {wanted} is not usable, {problem}; pick another step")
        return wanted
    try:
        return next(ckpt.intact_checkpoints(root))
    except (StopIteration, ckpt.CheckpointError) as e:
        raise ConfigError(f"{flag} {path}: no intact checkpoint ({e})") from None


def read_run(path: Path, flag: str = "--checkpoint") -> RunConfig:
    """The run the checkpoint at ``path`` records (checkpoints from before runs were recorded are
    refused: their objective and data are unknown)."""
    common = ckpt.load_common(path)
    if "run_config" in common:
        return RunConfig.from_dict(common["run_config"])
    if common.get("model_arch"):
        raise ConfigError(f"{flag} {path}: written before checkpoints recorded their run (objective, text "
                          "encoder, decoder); resume its training with this version for a step or more "
                          "(trainer.max_steps one higher) and generate from the new checkpoint")
    raise ConfigError(f"{flag} {path}: the checkpoint records neither its run nor its model; was it "
                      "written by dit_mcore's trainer?")


def weights_model_config(model: ModelConfig) -> ModelConfig:
    """``model`` (a run's model section) as the architecture only, to hold weights for sampling or converting:
    training-only speed and memory settings off (FP8, compile, recompute, the meta-device build)."""
    return dataclasses.replace(model, fp8=None, compile=False, recompute_granularity=None,
                               recompute_method=None, recompute_num_layers=None, recompute_modules=None,
                               init_model_with_meta_device=None)


def load_weights(chunks: ModelChunks, path: Path, *, weights: str, run: RunConfig, model_config,
                 fix: Optional[str] = None) -> None:
    """Load the checkpoint's ``weights`` ("ema": the EMA average the previews draw from; "model": the
    trained weights) into ``chunks``, each rank reading its own shards. A checkpoint of another
    model is refused before anything loads, naming the differing fields."""
    chunks.load_state_dict(read_weights(chunks, path, weights=weights, run=run, model_config=model_config, fix=fix),
                           strict=False)


def read_weights(chunks: ModelChunks, path: Path, *, weights: str, run: RunConfig, model_config,
                 fix: Optional[str] = None) -> dict:
    """The state dict of ``chunks`` with the checkpoint's ``weights`` (see :func:`load_weights`), read without
    loading it (collective: every rank calls it)."""
    if weights not in WEIGHTS:
        raise ConfigError(f"--weights {weights!r}: use one of {WEIGHTS}")
    prefix = "ema." if weights == "ema" else ""
    template = chunks.sharded_state_dict(prefix=prefix)
    ema_view = template if weights == "ema" else chunks.sharded_state_dict(prefix="ema.")
    arch = ckpt.architecture(model_config, run.model.family, run.model.preset)
    ckpt.refuse_other_model(path, ema_view, ckpt.load_common(path).get("model_arch"), arch, fix=fix)
    loaded = dist_checkpointing.load(template, str(path))
    ours = set(chunks.state_dict())
    state = {k.removeprefix(prefix): v for k, v in loaded.items() if k.startswith(prefix)}
    state = {k: v for k, v in state.items() if k in ours}
    missing = [k for k in sorted(ours - state.keys()) if not k.endswith("._extra_state")]
    if missing:
        raise ConfigError(f"checkpoint {path} has no {weights} weights for {len(missing)} tensors (e.g. {missing[0]})")
    return state


def save_weights(out: str | Path, model: ModelChunks, run: RunConfig, *, model_config, source: dict) -> Path:
    """Write ``model`` (whole, in a one-process world) as the checkpoint ``out/step_00000000`` (``out``: a new
    folder; the checkpoint is published whole or not at all) that generation, conversion and
    ``trainer.init_from`` read like a trained run's: the weights under both names (``--weights ema`` and ``model`` read the same), step 0, ``run`` as the
    run it records and ``source`` (where the weights came from) beside it. Holds no optimizer state: it
    starts runs, it does not resume them."""
    folder, out = Path(out), Path(out) / "step_00000000"
    if folder.exists() and any(folder.iterdir()):
        raise ConfigError(f"{folder}: not empty; give a new folder (nothing is overwritten)")
    partial = folder / f".partial_{out.name}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    state = {"model": model.sharded_state_dict(), "ema": model.sharded_state_dict(prefix="ema."), "step": 0,
             "world_size": 1, "run_config": run.to_dict(), "imported_from": source,
             "model_arch": ckpt.architecture(model_config, run.model.family, run.model.preset)}
    with ckpt.write_results_queue(asynchronous=False):
        dist_checkpointing.save(state, str(partial))
    ckpt.write_manifest(partial)
    partial.rename(out)
    log.info("wrote the checkpoint %s (weights from %s)", out, source.get("path"))
    return out
