"""A model's base weights as LoRA and QLoRA see them: which linears may carry an adapter (and are quantised
under `lora.quantize=nf4`), and which 3-D parameters are routed experts (quantised per expert, never adapted).

Below both lora.py and quantize.py: each reads these names from here, so neither imports the other for them.
"""

from __future__ import annotations

from torch import nn

# tied to the vocabulary (and possibly to each other): adapting them is a different method, not a target
NEVER_TARGETED = ("lm_head", "embed_tokens")
# modules that never receive a gradient from the loss (glm52's DSA indexer runs without autograd)
NO_GRADIENT_SCOPES = ("indexer",)
# glm52's routed experts: [E, 2I, C] and [E, C, I], one matrix per expert (models/glm52/model.py's `Experts`,
# HF's in-memory names); they are no nn.Linear, so LoRA never targets them
ROUTED_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def candidate_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear that may carry an adapter: not lm_head, not one sharing an embedding's weight, not one under
    a scope without gradients."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {
        name: m for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.split(".")[-1] not in NEVER_TARGETED
        and id(m.weight) not in embedding_weights and not set(name.split(".")) & set(NO_GRADIENT_SCOPES)
    }


def routed_experts(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(owning module, parameter name) of every routed-expert weight under `model`: a 3-D Parameter named in
    ROUTED_EXPERT_WEIGHTS (qwen36's 3-D conv weights are not)."""
    return [(module, name) for module in model.modules() for name, p in module.named_parameters(recurse=False)
            if name in ROUTED_EXPERT_WEIGHTS and p.dim() == 3]


__all__ = ["NEVER_TARGETED", "NO_GRADIENT_SCOPES", "ROUTED_EXPERT_WEIGHTS", "candidate_linears", "routed_experts"]
