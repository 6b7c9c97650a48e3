"""Analyses of a trained model through the generation path: :mod:`~dit_mcore.analysis.redundancy` (where
the model repeats itself from one sampler step to the next, per layer)."""
