"""Weight interop with the reference DiT implementations (facebookresearch/DiT, diffusers).

Conversions work on whole models in a single-process megatron world (TP = PP = 1); the same functions
in :mod:`dit_mcore.convert` set one up in a plain interpreter (no setup needed). Save a megatron
checkpoint afterwards to train or sample with another parallel layout.
"""
from dit_mcore.models.dit.interop.diffusers_dit import export_diffusers, load_diffusers
from dit_mcore.models.dit.interop.facebookresearch import export_facebookresearch, load_facebookresearch
from dit_mcore.models.dit.interop.mapping import InteropError
from dit_mcore.models.dit.interop.reference import reference_forward

__all__ = ["InteropError", "export_diffusers", "export_facebookresearch", "load_diffusers",
           "load_facebookresearch", "reference_forward"]
