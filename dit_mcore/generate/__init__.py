"""Generation from trained checkpoints: the one sampling home (training previews call it too), the
``python -m dit_mcore.generate`` command and parallel sampling layouts.

- ``items``: what a call makes, each item's noise from ``(seed, index)``;
- ``sampling``: items -> latents (conditioning, the objective's sampler, CFG batched or CFG-parallel);
- ``media``: latents -> decoded pixels -> PNG / GIF / MP4, grids and strips (``grid``: the grid PNG);
- ``layout``: generation layouts (training's ``parallel.*`` plus ``cfg_parallel``; items share the rest);
- ``checkpoint``: a run's checkpoint -> its run config and a model loaded for the layout;
- ``job`` and ``cli``: the command.

``items``, ``sampling``, ``media`` and ``grid`` sit below the trainer (its previews import them);
``checkpoint``, ``layout``, ``job`` and ``cli`` above it (they read its run config and checkpoints).
"""
