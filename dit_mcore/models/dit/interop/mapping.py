"""Key/layout tables between our ``DiT`` parameters and an external state dict.

A :class:`Rule` ties one of our parameters to one or more external tensors (diffusers splits our
fused qkv into three, and repeats the conditioning embedder in every block). The same table drives
import and export, and export of a freshly built model gives the expected external keys and shapes
that an incoming checkpoint is checked against before any tensor is converted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from dit_mcore.models.dit.config import DiTConfig
from dit_mcore.models.dit.model import DiT, build_model



class InteropError(ValueError):
    """A checkpoint or model cannot be converted; the message names the keys/fields and the fix."""


def _first(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _one(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


@dataclass(frozen=True)
class Rule:
    """One of our parameters and the external tensor(s) it corresponds to."""

    ours: str
    """Our parameter name (``model.named_parameters()``)."""

    theirs: tuple[str, ...]
    """External state-dict key(s)."""

    to_ours: Callable[[Sequence[torch.Tensor]], torch.Tensor] = _first
    """External tensors (in ``theirs`` order) -> our tensor."""

    to_theirs: Callable[[torch.Tensor], Sequence[torch.Tensor]] = _one
    """Our tensor -> external tensors (in ``theirs`` order)."""


def export_tensors(rules: Sequence[Rule], ours: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for rule in rules:
        for key, tensor in zip(rule.theirs, rule.to_theirs(ours[rule.ours])):
            out[key] = tensor
    return out


def check_keys_and_shapes(given: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                          *, source: str, hint: str) -> None:
    """Raise one error listing every missing, unexpected and mis-shaped key."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    shapes = sorted(f"{k}: checkpoint {tuple(given[k].shape)}, model expects {tuple(expected[k].shape)}"
                    for k in set(given) & set(expected) if tuple(given[k].shape) != tuple(expected[k].shape))
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if shapes:
        problems.append("shape mismatches:\n  " + "\n  ".join(shapes))
    if problems:
        raise InteropError(f"{source} state dict does not match the model ({hint}):\n" + "\n".join(problems))


def import_tensors(rules: Sequence[Rule], theirs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {rule.ours: rule.to_ours([theirs[k] for k in rule.theirs]) for rule in rules}


def require_whole_model_world() -> None:
    """Interop converts whole models, so megatron must be a TP=PP=1 world (its layers need its parallel
    state even then). :mod:`dit_mcore.convert` sets up a world of one for a plain interpreter."""
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        raise InteropError("interop builds megatron layers, which need megatron's parallel state: use the same "
                           "functions from dit_mcore.convert (they set up a world of one), or call "
                           "dit_mcore.parallel.initialize.whole_model_world() first")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if tp != 1 or pp != 1:
        raise InteropError(f"interop needs whole (unsharded) models but tensor/pipeline parallel sizes are "
                           f"{tp}/{pp}; convert in a single-process world, save a megatron checkpoint and "
                           "load that with the parallel layout you want")


def _refuse_adaln_lora(config, source: str) -> None:
    if getattr(config, "adaln_lora_rank", 0):
        raise InteropError(f"model.adaln_lora_rank={config.adaln_lora_rank}: {source} has a full adaLN linear per "
                           "layer, no AdaLN-LoRA; export with --to safetensors (our own names), or train with "
                           "model.adaln_lora_rank=0")


def build_and_load(config: DiTConfig, rules: Sequence[Rule], theirs: Mapping[str, torch.Tensor],
                   *, source: str, hint: str, extra_expected: Optional[Mapping[str, torch.Tensor]] = None) -> DiT:
    """Build our model for ``config``, check ``theirs`` against it and copy the converted weights in."""
    require_whole_model_world()
    _refuse_adaln_lora(config, source)
    model = build_model(config)
    params = dict(model.named_parameters())
    missing_rules = sorted(set(params) - {r.ours for r in rules})
    assert not missing_rules, f"interop table has no rule for {missing_rules}"  # a bug in this package
    expected = {**export_tensors(rules, {k: p.detach() for k, p in params.items()}), **(extra_expected or {})}
    check_keys_and_shapes(theirs, expected, source=source, hint=hint)
    with torch.no_grad():
        for name, tensor in import_tensors(rules, theirs).items():
            params[name].copy_(tensor)
    return model


def export_model(model: DiT, rules: Sequence[Rule]) -> dict[str, torch.Tensor]:
    """``model``'s parameters as external tensors (sharing storage where no layout change is needed)."""
    require_whole_model_world()
    _refuse_adaln_lora(model.config, "facebookresearch/DiT or diffusers")
    if not (model.pre_process and model.post_process and len(model.layers) == model.config.num_layers):
        raise InteropError("interop needs the whole model (all layers, first and last pipeline stage); "
                           "build it with build_model(config) in a TP=PP=1 world")
    return export_tensors(rules, {k: p.detach() for k, p in model.named_parameters()})
