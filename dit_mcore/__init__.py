"""dit-mcore: Diffusion Transformers on megatron-core."""
from dit_mcore.config import ConfigError, DiTConfig, PRESETS, preset

__version__ = "0.1.0"
__all__ = ["DiTConfig", "ConfigError", "PRESETS", "preset"]
