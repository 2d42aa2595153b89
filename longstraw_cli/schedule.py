"""Learning-rate schedules: the rate of optimizer step `step` (0-based) is lr x factor(step), a pure function of the
step, so a resumed run sets the same rate with nothing to save.

Warmup rises linearly over `warmup_steps` (step 0 takes lr / warmup_steps, step warmup_steps - 1 the full lr);
the schedule then runs from 1 at the first step after warmup towards `min_lr_ratio`, which it reaches after the
last step, as Hugging Face's `get_cosine_schedule_with_warmup` and torch's `CosineAnnealingLR` (T_max = the decay
steps) do: every step moves the weights, none is spent at a rate of 0. Each schedule is a small registered
function of the progress p in [0, 1) after warmup.
"""

from __future__ import annotations

import math
from collections.abc import Callable

SCHEDULES: dict[str, Callable[[float], float]] = {}


def register_schedule(name: str):
    def register(fn: Callable[[float], float]) -> Callable[[float], float]:
        assert name not in SCHEDULES, f"schedule {name!r} registered twice"
        SCHEDULES[name] = fn
        return fn

    return register


@register_schedule("constant")
def constant(p: float) -> float:
    return 1.0


@register_schedule("linear")
def linear(p: float) -> float:
    return 1.0 - p


@register_schedule("cosine")
def cosine(p: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * p))


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float = 0.0) -> float:
    """The multiplier of the base learning rate at optimizer step `step` of `total_steps`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r}; valid: {sorted(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    # p = 1 falls on step total_steps, the one after the last
    decay_steps = max(total_steps - warmup_steps, 1)
    p = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * SCHEDULES[schedule](p)
