"""Generating from weights trained elsewhere: a diffusers ``DiTTransformer2DModel`` directory
(``--diffusers``) or a facebookresearch/DiT state dict (``--facebookresearch``), converted by
:mod:`dit_mcore.models.dit.interop` and sampled with the objective they were trained with, the original DiT's
DDPM (DDIM, 50 steps, guidance 4: diffusers' ``DiTPipeline`` defaults).

Interop builds whole models, so imported weights generate under the layouts that keep the model
whole on every rank: CFG-parallel and items shared over ranks. For tensor, sequence or pipeline
parallel, write them as a dit_mcore checkpoint first (``python -m dit_mcore.convert SRC OUT --to checkpoint``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from dit_mcore.errors import ConfigError
from dit_mcore.training.config import RunConfig
from dit_mcore.training.init_from import FACEBOOKRESEARCH_PRESET, external_run, facebookresearch_state, interop_errors

KINDS = ("diffusers", "facebookresearch")


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
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"--{kind} {path}: no such {'directory' if kind == 'diffusers' else 'file'}")
        state = None
        with interop_errors(f"--{kind}", path, "--preset", preset):
            if kind == "diffusers":
                from dit_mcore.models.dit.interop.diffusers_dit import diffusers_config
                config = diffusers_config(str(path))
            elif kind == "facebookresearch":
                from dit_mcore.models.dit.interop.facebookresearch import facebookresearch_config
                preset = preset or FACEBOOKRESEARCH_PRESET
                state = facebookresearch_state(path, f"--{kind}")
                config = facebookresearch_config(state, preset)
            else:
                raise ConfigError(f"unknown weights format {kind!r}; use one of {KINDS}")
        return cls(kind=kind, path=path, preset=preset, model_config=config, state=state,
                   run=external_run(config, preset))

    def check_layout(self, parallel) -> None:
        split = {name: getattr(parallel, name) for name in ("tensor_model_parallel_size", "context_parallel_size",
                                                             "pipeline_model_parallel_size", "expert_model_parallel_size")
                 if getattr(parallel, name) > 1}
        if parallel.patches() > 1:
            split["pipefusion_patches"] = parallel.patches()
        if split:
            raise ConfigError(f"--{self.kind}: imported weights generate whole on every rank (CFG-parallel and items "
                              f"over ranks), not with {', '.join(f'parallel.{k}={v}' for k, v in split.items())}; "
                              "write them as a dit_mcore checkpoint first (python -m dit_mcore.convert SRC OUT --to checkpoint) to "
                              "sample with model or sequence parallelism")

    def load(self):
        """Our ``DiT`` with the converted weights (megatron's groups must be TP = PP = 1)."""
        from dit_mcore.models.dit.interop import load_diffusers, load_facebookresearch
        if self.kind == "diffusers":
            return load_diffusers(str(self.path))
        return load_facebookresearch(self.state, self.preset)
