from longstraw_cli.models.qwen36.config import NAMED_CONFIGS, Qwen36Config, named_config
from longstraw_cli.models.qwen36.model import Qwen36ForCausalLM

__all__ = ["NAMED_CONFIGS", "Qwen36Config", "Qwen36ForCausalLM", "named_config"]
