"""dit-mcore: Diffusion Transformers on megatron-core.

Importing the package imports nothing else: the layers below it (``kernels``, ``energon_data``,
then ``dit_mcore.diffusion``, ``models``, ``parallel``, ``training``, ``generate``; see
``docs/README.md``) are imported where they are used.
"""
import warnings

from dit_mcore.errors import ConfigError

# megatron-core warns once per module, at import, that Transformer Engine or apex is missing (five
# UserWarnings at every start); the trainer says it in one INFO line instead (models.specs.fallbacks_line).
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed",
                        category=UserWarning, module=r"megatron\.")

__version__ = "0.1.0"
__all__ = ["ConfigError"]
