"""Objectives by name, as recipes and configs refer to them."""
from __future__ import annotations

import dataclasses

from dit_mcore.diffusion.ddpm import DDPMConfig, DDPMObjective
from dit_mcore.diffusion.edm import EDMConfig, EDMObjective
from dit_mcore.diffusion.flow import FlowConfig, FlowObjective
from dit_mcore.diffusion.objective import Objective

OBJECTIVES = {"flow": (FlowObjective, FlowConfig), "edm": (EDMObjective, EDMConfig), "ddpm": (DDPMObjective, DDPMConfig)}
DEFAULT_OBJECTIVE = "flow"


def build_objective(name: str = DEFAULT_OBJECTIVE, **kwargs) -> Objective:
    """Build the objective ``name`` ("flow", "edm" or "ddpm"); ``kwargs`` are fields of its config dataclass."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown diffusion objective {name!r}; valid names: {sorted(OBJECTIVES)}")
    cls, config_cls = OBJECTIVES[name]
    valid = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise ValueError(f"unknown {config_cls.__name__} field(s) {unknown} for objective {name!r}; "
                         f"valid fields: {sorted(valid)}")
    return cls(config_cls(**kwargs))
