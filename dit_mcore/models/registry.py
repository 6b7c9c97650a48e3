"""Model families by name. The trainer, previews and interop reach a family only through its entry,
so a new family (cross-attention DiT, Llama-style DiT, ST-DiT, MoE variants) is one new entry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class ModelFamily:
    """What the rest of the project needs to know about one family."""

    name: str
    presets: Callable[[], dict]
    """``() -> {preset name: config overrides}``."""
    make_config: Callable[..., object]
    """``(preset_name, **overrides) -> config`` (a megatron ``TransformerConfig`` subclass)."""
    layer_spec: Callable[..., object]
    """``(backend, ...) -> ModuleSpec`` of one layer."""
    build: Callable[..., object]
    """``(config, *, backend, pre_process, post_process, vp_stage, init_seed) -> model`` for this rank
    (``init_seed``: one per rank for all its pipeline chunks, see ``dit_mcore.models.seeding``)."""
    token_model_fn: Callable[..., Callable]
    """``(model, config, batch) -> fn(x [b,s,D], timestep [n], labels) -> prediction [b,s,patch_dim]``:
    the objective adapter used by training and sampling."""
    image_model_fn: Callable[..., Callable]
    """``(model, config) -> fn(x [N,C,(T,)H,W], timestep, labels)``: the sampler adapter for previews."""
    interop: Callable[[], dict] = dict
    """``() -> {format name: (load, export)}`` converters to external checkpoints (imported lazily)."""
    conditioning: tuple = ("labels",)
    """Conditioning inputs the family consumes (``labels``, ``text``)."""
    flops: Optional[Callable[..., object]] = None
    """``(config, seqlens, context_lens=None, frames=None) -> DiTFlops``: forward FLOPs of a micro-batch
    from its samples' real token counts, text lengths and frame counts (``dit_mcore.training.flops``),
    for the logged FLOPs and MFU."""


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    _FAMILIES[family.name] = family
    return family


def _load_builtin() -> None:
    import dit_mcore.models.dit  # noqa: F401  (registers "dit")
    import dit_mcore.models.dit.xattn  # noqa: F401  (registers "dit_xattn")
    import dit_mcore.models.dit.llama  # noqa: F401  (registers "llama")
    import dit_mcore.models.dit.stdit  # noqa: F401  (registers "stdit")


def get_family(name: str) -> ModelFamily:
    _load_builtin()
    if name not in _FAMILIES:
        raise ValueError(f"model.family={name!r} is unknown; registered families: {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[name]


def families() -> list[str]:
    _load_builtin()
    return sorted(_FAMILIES)


def find_preset(preset: str) -> Optional[str]:
    """The family that defines ``preset``, if any."""
    _load_builtin()
    return next((f.name for f in _FAMILIES.values() if preset in f.presets()), None)
