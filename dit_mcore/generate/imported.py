"""Generating from weights trained elsewhere: a diffusers ``DiTTransformer2DModel`` directory
(``--diffusers``) or a facebookresearch/DiT state dict (``--facebookresearch``), converted by
:mod:`dit_mcore.models.dit.interop` and sampled with the objective they were trained with, the original DiT's
DDPM (DDIM, 50 steps, guidance 4: diffusers' ``DiTPipeline`` defaults).

Interop builds whole models, so imported weights generate under the layouts that keep the model
whole on every rank: CFG-parallel and items shared over ranks. For tensor, sequence or pipeline
parallel, save them as a dit_mcore checkpoint first.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch

from dit_mcore.errors import ConfigError
from dit_mcore.training.config import DiffusionConfig, ModelConfig, RunConfig

KINDS = ("diffusers", "facebookresearch")
SAMPLING = dict(objective="ddpm", sample_steps=50, cfg_scale=4.0)
"""The original DiT's objective with diffusers' ``DiTPipeline`` defaults."""


def _facebookresearch_state(path: Path) -> Mapping[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, Mapping) and isinstance(state.get("ema"), Mapping):  # a training checkpoint: its EMA
        state = state["ema"]
    if not isinstance(state, Mapping):
        raise ConfigError(f"--facebookresearch {path}: not a state dict (a DiT-XL-2-256x256.pt-style file)")
    return state


@dataclass
class Imported:
    """External weights, described without building anything: the run to sample them as and their
    architecture (a ``DiTConfig``)."""

    kind: str
    path: Path
    preset: Optional[str]
    model_config: object
    run: RunConfig
    state: Optional[Mapping] = None

    @classmethod
    def describe(cls, kind: str, path: str, preset: Optional[str] = None) -> "Imported":
        from dit_mcore.models.dit.interop.mapping import InteropError
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"--{kind} {path}: no such {'directory' if kind == 'diffusers' else 'file'}")
        state = None
        try:
            if kind == "diffusers":
                from dit_mcore.models.dit.interop.diffusers_dit import diffusers_config
                config = diffusers_config(str(path))
            elif kind == "facebookresearch":
                from dit_mcore.models.dit.interop.facebookresearch import facebookresearch_config
                preset = preset or "DiT-XL/2"
                state = _facebookresearch_state(path)
                config = facebookresearch_config(state, preset)
            else:
                raise ConfigError(f"unknown weights format {kind!r}; use one of {KINDS}")
        except InteropError as e:
            raise ConfigError(f"--{kind} {path}: {e}") from None
        except ValueError as e:  # an unknown preset
            raise ConfigError(f"--preset {preset}: {e}") from None
        fields = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "patch_size", "input_size",
                  "in_channels", "num_classes", "learn_sigma")
        model = ModelConfig(family="dit", preset=preset or "imported", **{f: getattr(config, f) for f in fields})
        return cls(kind=kind, path=path, preset=preset, model_config=config, state=state,
                   run=RunConfig(model=model, diffusion=DiffusionConfig(**SAMPLING)))

    def check_layout(self, parallel) -> None:
        split = {name: getattr(parallel, name) for name in ("tensor_model_parallel_size", "context_parallel_size",
                                                             "pipeline_model_parallel_size", "expert_model_parallel_size")
                 if getattr(parallel, name) > 1}
        if parallel.patches() > 1:
            split["pipefusion_patches"] = parallel.patches()
        if split:
            raise ConfigError(f"--{self.kind}: imported weights generate whole on every rank (CFG-parallel and items "
                              f"over ranks), not with {', '.join(f'parallel.{k}={v}' for k, v in split.items())}; "
                              "save them as a dit_mcore checkpoint to sample with model or sequence parallelism")

    def load(self):
        """Our ``DiT`` with the converted weights (megatron's groups must be TP = PP = 1)."""
        from dit_mcore.models.dit.interop import load_diffusers, load_facebookresearch
        if self.kind == "diffusers":
            return load_diffusers(str(self.path))
        return load_facebookresearch(self.state, self.preset)
