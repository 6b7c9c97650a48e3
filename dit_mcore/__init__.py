"""dit-mcore: Diffusion Transformers on megatron-core.

Importing the package imports nothing else: the layers below it (``kernels``, ``energon_data``,
then ``dit_mcore.diffusion``, ``models``, ``parallel``, ``training``, ``generate``; see
``docs/README.md``) are imported where they are used.
"""
from dit_mcore.errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError"]
