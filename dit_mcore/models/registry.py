"""Model families by name. The trainer, previews and interop reach a family only through its entry
(:class:`~dit_mcore.models.family.ModelFamily`), so a new family (cross-attention DiT, Llama-style DiT,
ST-DiT, MoE variants) is one new entry: its module defines ``FAMILY``, and :func:`register` (or the
built-in list below) adds it. The registry imports the families; no family imports the registry.
"""
from __future__ import annotations

import importlib
from typing import Optional

from dit_mcore.models.family import ModelFamily

_BUILTIN = ("dit_mcore.models.dit", "dit_mcore.models.dit.xattn", "dit_mcore.models.dit.llama",
            "dit_mcore.models.dit.stdit")


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    if _FAMILIES.get(family.name, family) is not family:
        raise ValueError(f"model family {family.name!r} is registered twice")
    _FAMILIES[family.name] = family
    return family


def _load_builtin() -> None:
    for module in _BUILTIN:  # imported on first use: importing the registry pulls no family
        register(importlib.import_module(module).FAMILY)


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
