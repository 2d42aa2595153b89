"""A model's base weights as LoRA and QLoRA see them: which linears may carry an adapter (and are quantised
under `lora.quantize=nf4`).

Below both lora.py and quantize.py: each reads these names from here, so neither imports the other for them.
"""

from __future__ import annotations

from torch import nn

# tied to the vocabulary (and possibly to each other): adapting them is a different method, not a target
NEVER_TARGETED = ("lm_head", "embed_tokens")
# modules that never receive a gradient from the loss (glm52's DSA indexer runs without autograd)
NO_GRADIENT_SCOPES = ("indexer",)


def candidate_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear that may carry an adapter: not lm_head, not one sharing an embedding's weight, not one under
    a scope without gradients."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {
        name: m for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.split(".")[-1] not in NEVER_TARGETED
        and id(m.weight) not in embedding_weights and not set(name.split(".")) & set(NO_GRADIENT_SCOPES)
    }


__all__ = ["NEVER_TARGETED", "NO_GRADIENT_SCOPES", "candidate_linears"]
