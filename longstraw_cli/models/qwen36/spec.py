"""The qwen36 family's registration: Qwen3.6 (Gated DeltaNet + gated attention), HF `qwen3_5_text` / `qwen3_5`."""

from longstraw_cli.lora import DEFAULT_TARGETS
from longstraw_cli.models.qwen36 import hf
from longstraw_cli.models.qwen36.config import NAMED_CONFIGS, named_config
from longstraw_cli.models.qwen36.model import Qwen36ForCausalLM
from longstraw_cli.models.spec import FamilySpec, register_family

SPEC = register_family(FamilySpec(
    name="qwen36",
    model_cls=Qwen36ForCausalLM,
    configs=NAMED_CONFIGS,
    named_config=named_config,
    hf=hf.ADAPTER,
    lora_targets=DEFAULT_TARGETS,
    context_parallel="longstraw_cli.distributed.cp:apply_context_parallel_qwen36",
    plan="longstraw_cli.plan.qwen36:plan",
    flops="longstraw_cli.plan.flops:qwen36_capture_flops",
    fast_paths=("fla", "triton"),
))
