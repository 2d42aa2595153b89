"""Advantage estimators: G scalar rewards of one prompt -> G scalar advantages (or weights).

Outcome rewards only: one reward per response, no per-token rewards and no value model, so an
advantage is a single float that the loss broadcasts over the response's tokens. Estimators are
registered by name with their kind; `get_advantage(name)` returns the function:

    baseline  relative to the group, for the policy-gradient losses (grpo, dr_grpo): a group needs >= 2
    weight    each response's own weight, for algo=sft (one: every response 1; reward: the reward itself,
              reward-weighted SFT; 0/1 rewards keep the accepted responses): a group of 1 is a group

Legend: `_G` is the group axis (one entry per response to the same prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

AdvantageFn = Callable[[Tensor], Tensor]

# the kinds of estimator, and the fewest responses a group of each needs
KINDS = {"baseline": 2, "weight": 1}


@dataclass(frozen=True)
class Estimator:
    fn: AdvantageFn
    kind: str


ADVANTAGE_REGISTRY: dict[str, Estimator] = {}

# Added to the std so that a group of equal rewards gives advantage 0 instead of 0/0 (verl's value).
GRPO_STD_EPS = 1e-6


def register_advantage(name: str, kind: str = "baseline") -> Callable[[AdvantageFn], AdvantageFn]:
    assert kind in KINDS, kind

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_REGISTRY[name] = Estimator(fn, kind)
        return fn

    return decorator


def _estimator(name: str) -> Estimator:
    if name not in ADVANTAGE_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; valid choices: {sorted(ADVANTAGE_REGISTRY)}")
    return ADVANTAGE_REGISTRY[name]


def get_advantage(name: str) -> AdvantageFn:
    return _estimator(name).fn


def advantage_kind(name: str) -> str:
    """"baseline" or "weight" (see the module docstring)."""
    return _estimator(name).kind


def min_group_size(name: str) -> int:
    """The fewest responses a group needs under estimator `name`."""
    return KINDS[advantage_kind(name)]


def _checked_rewards(rewards_G: Tensor, least: int = 2) -> Tensor:
    if rewards_G.dim() != 1 or rewards_G.numel() < least:
        raise ValueError(
            f"rewards must be a 1-D tensor of at least {least} group member{'s' * (least > 1)}"
            f"{' (a group of 1 has no baseline)' if least > 1 else ''}, got shape {tuple(rewards_G.shape)}"
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


@register_advantage("one", kind="weight")
def one_weight(rewards_G: Tensor) -> Tensor:
    """Every response weight 1: plain SFT (the rewards are only logged)."""
    return torch.ones_like(_checked_rewards(rewards_G, least=1))


@register_advantage("reward", kind="weight")
def reward_weight(rewards_G: Tensor) -> Tensor:
    """The reward as the response's weight: reward-weighted SFT (0/1 rewards: rejection-sampling fine-tuning)."""
    return _checked_rewards(rewards_G, least=1)
