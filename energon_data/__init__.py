"""Everything between raw media and a packed micro-batch.

Submodules (imported on demand so that ``import energon_data`` stays cheap and never pulls
in diffusers/transformers/PIL):

- ``energon_data.datasets``: built-in datasets (``load_digits``, ``moving_digits``).
- ``energon_data.encoders``: registry of latent and text encoders, chosen by name.
- ``energon_data.media``: reading images and videos from disk.
- ``energon_data.shards``: writing webdataset shards and energon's index metadata.
- ``energon_data.prepare``: the ``python -m energon_data.prepare`` tool and ``prepare_dataset``.
"""
