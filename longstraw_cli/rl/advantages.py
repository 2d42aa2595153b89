"""Group-relative advantage estimators: G scalar rewards of one prompt -> G scalar advantages.

Outcome rewards only: one reward per response, no per-token rewards and no value model, so an
advantage is a single float that the loss broadcasts over the response's tokens. Estimators are
registered by name; `get_advantage(name)` returns the function.

Legend: `_G` is the group axis (one entry per response to the same prompt).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

AdvantageFn = Callable[[Tensor], Tensor]

ADVANTAGE_REGISTRY: dict[str, AdvantageFn] = {}

# Added to the std so that a group of equal rewards gives advantage 0 instead of 0/0 (verl's value).
GRPO_STD_EPS = 1e-6


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_REGISTRY[name] = fn
        return fn

    return decorator


def get_advantage(name: str) -> AdvantageFn:
    if name not in ADVANTAGE_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; valid choices: {sorted(ADVANTAGE_REGISTRY)}")
    return ADVANTAGE_REGISTRY[name]


def _checked_rewards(rewards_G: Tensor) -> Tensor:
    if rewards_G.dim() != 1 or rewards_G.numel() < 2:
        raise ValueError(
            f"rewards must be a 1-D tensor of at least 2 group members (a group of 1 has no baseline), "
            f"got shape {tuple(rewards_G.shape)}"
        )
    rewards_G = rewards_G.detach().to(torch.promote_types(rewards_G.dtype, torch.float32))
    if not torch.isfinite(rewards_G).all():
        raise ValueError(f"rewards must be finite, got {rewards_G.tolist()}")
    return rewards_G


@register_advantage("grpo")
def grpo_advantage(rewards_G: Tensor) -> Tensor:
    """(r - mean) / (std + eps), std with Bessel's correction (unbiased), as verl's torch.std and TRL."""
    rewards_G = _checked_rewards(rewards_G)
    return (rewards_G - rewards_G.mean()) / (rewards_G.std(unbiased=True) + GRPO_STD_EPS)


@register_advantage("dr_grpo")
def dr_grpo_advantage(rewards_G: Tensor) -> Tensor:
    """r - mean: Dr. GRPO drops the std division, which over-weights groups of near-equal rewards."""
    rewards_G = _checked_rewards(rewards_G)
    return rewards_G - rewards_G.mean()
