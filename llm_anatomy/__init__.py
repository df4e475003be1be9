"""efficient-llm-anatomy: where every byte and FLOP of a transformer training step goes."""
from llm_anatomy.config import ConfigError, ModelConfig, Run, PRESETS
from llm_anatomy.hf_config import from_hf_config

__all__ = ["ConfigError", "ModelConfig", "Run", "PRESETS", "from_hf_config"]
__version__ = "0.1.0"
