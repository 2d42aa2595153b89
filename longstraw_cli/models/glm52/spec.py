"""The glm52 family's registration: GLM-5 (MLA + DSA + MoE), HF `glm_moe_dsa`."""

from longstraw_cli.models.glm52 import hf
from longstraw_cli.models.glm52.config import NAMED_CONFIGS, named_config
from longstraw_cli.models.glm52.model import Glm52ForCausalLM
from longstraw_cli.models.spec import FamilySpec, register_family

SPEC = register_family(FamilySpec(
    name="glm52",
    model_cls=Glm52ForCausalLM,
    configs=NAMED_CONFIGS,
    named_config=named_config,
    hf=hf.ADAPTER,
    # routed experts are 3-D parameters, not nn.Linear: they are not adapted
    lora_targets=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                  "down_proj"),
    context_parallel="longstraw_cli.distributed.cp_glm52:apply_context_parallel_glm52",
    expert_parallel="longstraw_cli.distributed.ep:apply_expert_parallel",
    plan="longstraw_cli.plan.glm52:plan",
    flops="longstraw_cli.plan.flops:glm52_capture_flops",
    fast_paths=("triton",),
    routing="longstraw_cli.models.glm52.routing:RoutingReplay",
))
