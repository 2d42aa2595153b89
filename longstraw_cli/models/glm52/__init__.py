from longstraw_cli.models.glm52.config import NAMED_CONFIGS, Glm52Config, named_config
from longstraw_cli.models.glm52.model import Glm52ForCausalLM

__all__ = ["NAMED_CONFIGS", "Glm52Config", "Glm52ForCausalLM", "named_config"]
