"""A run's first weights from elsewhere (``trainer.init_from``): another run's checkpoint, a diffusers
``DiTTransformer2DModel`` folder, a facebookresearch/DiT state dict, or a safetensors file of our own tensors.
Fine-tuning: the model and its EMA start from the source's weights; the optimizer, the schedule and the step
start fresh. The model's shape fields the run leaves unset come from the source.

Weights from another library are first written as a dit_mcore checkpoint of the whole model by one process
(:func:`import_weights`, also ``python -m dit_mcore.convert SRC OUT --to checkpoint``); every rank then reads
its shards of that checkpoint with megatron's dist_checkpointing, as a resume onto another layout does, so
any training layout starts from them. The weights are loaded where a random init would have put them,
before the data-parallel wrapper, the EMA and the optimizer copy them (a model built on the meta device under
FSDP: into its shards once FSDP has allocated them, before the EMA and the optimizer copy them).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import shutil
from pathlib import Path
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from dit_mcore.errors import ConfigError
from dit_mcore.models.registry import get_family
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.parallel.fsdp import FailedOnAnotherRank, shard_like, whole_checkpoint_view
from dit_mcore.parallel.pipeline import ModelChunks
from dit_mcore.training import checkpoint as ckpt
from dit_mcore.training.config import DiffusionConfig, ModelConfig, RunConfig
from dit_mcore.training.weights import find_checkpoint, read_weights, save_weights, weights_model_config

log = logging.getLogger(__name__)

KINDS = ("checkpoint", "diffusers", "facebookresearch", "safetensors")
EXTERNAL_SAMPLING = dict(objective="ddpm", sample_steps=50, cfg_scale=4.0)
"""How weights from diffusers or facebookresearch/DiT were trained and are sampled: the original DiT's DDPM
objective, with diffusers' ``DiTPipeline`` defaults (DDIM, 50 steps, guidance 4)."""

_SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "patch_size", "input_size",
          "in_channels", "num_classes", "learn_sigma", "timestep_freq_shift")
"""The architecture fields of the adaLN-Zero DiT that external weights fix (``ModelConfig`` names)."""


def detect(path: str | Path, flag: str) -> str:
    """Which of :data:`KINDS` ``path`` is (``flag``: the argument it came from, for the message)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{flag}={path}: no such file or directory")
    if p.is_dir():
        if (p / "checkpoints").is_dir() or any(p.glob("step_*")) or (p / "metadata.json").is_file():
            return "checkpoint"
        if (p / "config.json").is_file():
            return "diffusers"
        if (p / "model.safetensors").is_file():
            return "safetensors"
        hint = ("a diffusers pipeline: give its transformer/ folder" if (p / "transformer").is_dir() else
                f"give the .pt file in it, {(p / 'dit.pt')}" if (p / "dit.pt").is_file() else
                "give a run directory, its checkpoints/ or a step_* folder, or a diffusers folder with config.json")
        raise ConfigError(f"{flag}={path}: holds no weights this reads; {hint}")
    if p.suffix == ".safetensors":
        return "safetensors"
    if p.suffix in (".pt", ".pth", ".ckpt"):
        return "facebookresearch"
    raise ConfigError(f"{flag}={path}: not a weights source; give a run directory, its checkpoints/ or a step_* "
                      "folder, a diffusers folder (with config.json), a facebookresearch .pt state dict or a "
                      ".safetensors file")


FACEBOOKRESEARCH_PRESET = "DiT-XL/2"
"""The preset a facebookresearch/DiT state dict is read as unless one is given (the released checkpoints')."""


@contextlib.contextmanager
def interop_errors(flag: str, path, preset_flag: str, preset: Optional[str]):
    """Interop's refusals as one :class:`ConfigError` line naming the argument: a weights file it cannot read
    (``flag path: ...``), an unknown preset (``preset_flag preset: ...``)."""
    from dit_mcore.models.dit.interop.mapping import InteropError
    try:
        yield
    except InteropError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None
    except ValueError as e:  # an unknown preset
        raise ConfigError(f"{preset_flag} {preset}: {e}") from None


def facebookresearch_state(path: Path, flag: str) -> Mapping[str, torch.Tensor]:
    """The state dict of a facebookresearch/DiT file (a training checkpoint: its EMA)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, Mapping) and isinstance(state.get("ema"), Mapping):
        state = state["ema"]
    if not isinstance(state, Mapping):
        raise ConfigError(f"{flag} {path}: not a state dict (a DiT-XL-2-256x256.pt-style file)")
    return state


def _matching_preset(config) -> str:
    """The ``dit`` preset with ``config``'s depth, width, heads and patch (else DiT-XL/2's base: every shape
    field is set explicitly anyway)."""
    keys = ("num_layers", "hidden_size", "num_attention_heads", "patch_size")
    for name, values in get_family("dit").presets().items():
        if all(values.get(k) == getattr(config, k) for k in keys):
            return name
    return FACEBOOKRESEARCH_PRESET


def external_model(config, preset: Optional[str] = None) -> ModelConfig:
    """The ``ModelConfig`` that builds the adaLN-Zero DiT ``config`` (a ``DiTConfig`` converted from diffusers
    or facebookresearch/DiT): its preset and every shape field set."""
    return ModelConfig(family="dit", preset=preset or _matching_preset(config),
                       **{name: getattr(config, name) for name in _SHAPE})


def external_run(config, preset: Optional[str] = None) -> RunConfig:
    """The run external DiT weights are sampled as: :func:`external_model` with :data:`EXTERNAL_SAMPLING`."""
    return RunConfig(model=external_model(config, preset), diffusion=DiffusionConfig(**EXTERNAL_SAMPLING))


def _safetensors_run(file: Path, model: Optional[ModelConfig], flag: str) -> RunConfig:
    record = file.parent / "dit_mcore_source.json"
    if record.is_file():
        source = json.loads(record.read_text())
        diffusion = source.get("diffusion") or {"objective": source.get("objective", DiffusionConfig.objective)}
        return RunConfig(model=ModelConfig(**source["model"]), diffusion=DiffusionConfig(**diffusion))
    if model is None:
        raise ConfigError(f"{flag} {file}: no dit_mcore_source.json beside it to say which model it holds; "
                          "use the folder python -m dit_mcore.convert --to safetensors wrote, or start a run "
                          "from it with trainer.init_from (the run's model section describes it)")
    return RunConfig(model=model)


def import_weights(path: str | Path, out: str | Path, *, kind: Optional[str] = None, preset: Optional[str] = None,
                   model: Optional[ModelConfig] = None, flag: str = "SOURCE") -> Path:
    """Write the weights at ``path`` (``kind``: one of :data:`KINDS` but "checkpoint"; default detected) as
    a dit_mcore checkpoint at ``out`` (:func:`~dit_mcore.training.weights.save_weights`), building the whole
    model in this process (megatron's one-process world is set up if missing). ``preset``: a
    facebookresearch state dict's (default DiT-XL/2; ``model``'s shape fields that are set override it);
    ``model``: a safetensors file's model where no ``dit_mcore_source.json`` lies beside it."""
    from dit_mcore.models.dit import interop
    from dit_mcore.parallel.initialize import whole_model_world
    path = Path(path)
    kind = kind or detect(path, flag)
    if kind == "checkpoint":
        raise ConfigError(f"{flag} {path}: already a dit_mcore checkpoint (train or generate from it as it is)")
    whole_model_world()
    with interop_errors(flag, path, "--preset/model.preset", preset):
        if kind == "diffusers":
            dit = interop.load_diffusers(str(path))
            chunks, run, config = ModelChunks([dit]), external_run(dit.config), dit.config
        elif kind == "facebookresearch":
            preset = preset or FACEBOOKRESEARCH_PRESET
            overrides = {k: getattr(model, k) for k in _SHAPE if model is not None and getattr(model, k) is not None}
            dit = interop.load_facebookresearch(facebookresearch_state(path, flag), preset, **overrides)
            chunks, run, config = ModelChunks([dit]), external_run(dit.config, preset), dit.config
        elif kind == "safetensors":
            from safetensors.torch import load_file
            file = path / "model.safetensors" if path.is_dir() else path
            run = _safetensors_run(file, model, flag)
            run.model = weights_model_config(run.model)
            config = run.model.build(ParallelConfig())
            chunks = ModelChunks.of_family(get_family(run.model.family), config, backend=run.model.backend,
                                           device="cpu", dtype=torch.float32, seed=0)
            missing, unexpected = chunks[0].load_state_dict(load_file(str(file)), strict=False)
            missing = [k for k in missing if not k.endswith("._extra_state")]
            if missing or unexpected:
                raise ConfigError(f"{flag} {file}: not the weights of model.family={run.model.family} "
                                  f"preset={run.model.preset} ({len(missing)} tensors missing, e.g. "
                                  f"{(missing or ['-'])[0]}; {len(unexpected)} not in the model, e.g. "
                                  f"{(unexpected or ['-'])[0]})")
        else:
            raise ConfigError(f"{flag} {path}: unknown kind {kind!r}; use one of {', '.join(KINDS[1:])}")
    return save_weights(out, chunks.float(), run, model_config=config,
                        source={"kind": kind, "path": str(path.resolve())})


def take_architecture(model: ModelConfig, arch: Optional[dict], source: str, leave: frozenset = frozenset()) -> dict:
    """Set ``model``'s shape fields that are unset from ``arch`` (a checkpoint's ``model_arch``, from
    ``source``) but those in ``leave``, and return them; a source of another family is refused."""
    if not arch:
        return {}
    if arch.get("family") not in (None, model.family):
        raise ConfigError(f"{source} holds a model.family={arch['family']} model, this run builds "
                          f"model.family={model.family}; set model.family={arch['family']} (and its preset)")
    names = ({f.name for f in dataclasses.fields(ModelConfig)} & set(ckpt.ARCHITECTURE_FIELDS)) - set(leave)
    taken = {name: arch[name] for name in sorted(names)
             if getattr(model, name) is None and arch.get(name) is not None}
    for name, value in taken.items():
        setattr(model, name, value)
    return taken


def _raise_agreed(error: Optional[BaseException], context: str) -> None:
    """Raise on every rank if any rank met ``error``: its ConfigError as it is, anything else in ``context``."""
    reason = ckpt.agreed_failure(error)
    if reason is not None:
        raise ConfigError(reason.removeprefix("ConfigError: ") if reason.startswith("ConfigError: ") else
                          f"{context} ({reason})")


@dataclasses.dataclass
class InitialWeights:
    """Where a run's first weights come from: ``path`` a dit_mcore checkpoint (``imported``: written for
    this start from another library's weights, removed once every rank has read it)."""

    source: str
    kind: str
    path: Path
    weights: str
    imported: bool

    @classmethod
    def prepare(cls, cfg: RunConfig, run_dir: Path) -> "InitialWeights":
        """Every rank, with the world formed: find the checkpoint ``trainer.init_from`` names, or write
        one from another library's weights (rank 0, in a fresh process: the whole model, one process)."""
        source, flag = cfg.trainer.init_from, "trainer.init_from"
        kind = detect(source, flag)
        out, error = run_dir / "imported_weights", None
        found = [None]  # rank 0 decides, so every rank reads the same step even while the source run saves
        if dist.get_rank() == 0:
            try:
                if kind == "checkpoint":
                    found = [find_checkpoint(source, flag=flag)]
                else:
                    shutil.rmtree(out, ignore_errors=True)
                    context = multiprocessing.get_context("spawn")  # (this process's world is not a whole model's)
                    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
                        pool.submit(import_weights, source, out, kind=kind, preset=cfg.model.preset, model=cfg.model,
                                    flag=flag).result()  # (out/step_00000000)
            except Exception as e:  # noqa: BLE001 -- agreed on below, every rank raises it
                error = e
        _raise_agreed(error, f"{flag}={source}: its weights could not be read")
        if kind == "checkpoint":
            dist.broadcast_object_list(found, src=0)
            return cls(source, kind, Path(found[0]), cfg.trainer.init_weights, False)
        return cls(source, kind, out / "step_00000000", "ema", True)

    def architecture(self) -> Optional[dict]:
        return ckpt.load_common(self.path).get("model_arch")

    def load(self, chunks: ModelChunks, cfg: RunConfig, model_config) -> None:
        """Load the weights into this rank's ``chunks``, resharded: plain, before any wrapper, or sharded by FSDP
        (a model built on the meta device: read into whole copies of its weights, then cut to its shards)."""
        error = None
        try:
            with whole_checkpoint_view((chunks,), None, loading=True):  # (a no-op for plain chunks)
                state = read_weights(chunks, self.path, weights=self.weights, run=cfg, model_config=model_config,
                                     fix=f"(from trainer.init_from={self.source}) set the model's fields to the "
                                         "source's, or leave them unset to take its")
            chunks.load_state_dict(shard_like(state, chunks), strict=False)
        except FailedOnAnotherRank:  # (the failing rank's own error is agreed on below)
            error = None
        except Exception as e:  # noqa: BLE001 -- agreed on below (a rank raising alone would hang the others)
            error = e
        _raise_agreed(error, f"trainer.init_from={self.source}: its weights could not be loaded")

    def done(self) -> str:
        """After every rank has loaded: remove an imported copy; the log line saying where the run began."""
        if self.imported:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(self.path.parent, ignore_errors=True)
        what = f"the {self.weights} weights of {self.path}" if self.kind == "checkpoint" else \
            f"the {self.kind} weights at {self.source}"
        return f"initial weights: {what}; the optimizer, the learning-rate schedule and the step start fresh"
