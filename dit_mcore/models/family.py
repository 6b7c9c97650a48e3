"""What the rest of the project needs to know about one model family: the entry each family's
module defines as ``FAMILY`` and :mod:`dit_mcore.models.registry` collects by name."""
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
    from its samples' real token counts, text lengths and frame counts (``dit_mcore.models.flops``),
    for the logged FLOPs and MFU."""
