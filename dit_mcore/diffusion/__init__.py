"""Diffusion objectives (rectified flow, EDM), noise-level sampling, ODE samplers and CFG.

Pure torch. Every objective maps ``x0 [N, ...]`` and per-row noise levels ``[N]`` to the network's
input, timestep and regression target; see ``objective.py`` for the contract.
"""
from dit_mcore.diffusion.edm import EDMConfig, EDMObjective, Preconditioning
from dit_mcore.diffusion.flow import FlowConfig, FlowObjective
from dit_mcore.diffusion.guidance import drop_labels, guided
from dit_mcore.diffusion.objective import ModelFn, Objective, TrainInputs
from dit_mcore.diffusion.registry import DEFAULT_OBJECTIVE, OBJECTIVES, build_objective
from dit_mcore.diffusion.samplers import euler_flow, heun_edm, sample
from dit_mcore.diffusion.timesteps import flow_schedule, karras_sigmas, shift_time

__all__ = [
    "Objective", "TrainInputs", "ModelFn", "FlowConfig", "FlowObjective", "EDMConfig", "EDMObjective",
    "Preconditioning", "build_objective", "OBJECTIVES", "DEFAULT_OBJECTIVE", "drop_labels", "guided",
    "euler_flow", "heun_edm", "sample", "flow_schedule", "karras_sigmas", "shift_time",
]
