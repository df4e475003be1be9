"""efficient-llm-anatomy: where every byte and FLOP of a transformer training step goes."""
from anatomy.config import ConfigError, ModelConfig, Run, PRESETS
from anatomy.hf_config import from_hf_config

__all__ = ["ConfigError", "ModelConfig", "Run", "PRESETS", "from_hf_config"]
__version__ = "0.1.0"
