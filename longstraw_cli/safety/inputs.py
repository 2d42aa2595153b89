"""Checks of the run's data that the config cannot make: at load, not at step N.

- `check_prompts`: the prompts a task checks at start (every row of a jsonl file, the first row of a `dataset`
  file: `Task.examples_checked_at_start`) are tokenized once, the way the trainer will (`Trainer.prompt_ids`, chat
  template included); an empty one, or one that leaves no room for response_tokens within the model's positions,
  stops the run before any work with one line naming the row. `check_prompt` is the same check on a prompt the
  trainer tokenizes later (a `dataset` row as it is served, a validation row). Synthetic tasks are sized by
  prompt_tokens, which the config checks.
- `reward_value`: a reward must return a finite number; anything else stops the run with one line naming the
  reward and the row (rl/reward_adapters.py calls it for every style).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence

from longstraw_cli.rl.tasks import Example
from longstraw_cli.safety.errors import RunError


class InputError(RunError, ValueError):
    """A prompt or a reward's value the run cannot use (exit status 2)."""


class RewardError(InputError):
    """A reward failed on a row or returned what is not a finite number: one line naming the reward, the row and
    the cause."""


def check_prompts(examples: Iterable[Example], prompt_ids: Callable[[Example], Sequence[int]], max_positions: int,
                  response_tokens: int) -> None:
    """Raises InputError for the first of `examples` whose prompt is empty or longer than
    max_positions - response_tokens."""
    for example in examples:
        check_prompt(example, len(prompt_ids(example)), max_positions, response_tokens)


def check_prompt(example: Example, num_tokens: int, max_positions: int, response_tokens: int) -> None:
    room = max_positions - response_tokens
    if num_tokens == 0:
        raise InputError(f"{example.origin}: the prompt is empty (0 tokens)")
    if num_tokens > room:
        raise InputError(f"{example.origin}: the prompt is {num_tokens} tokens; with response_tokens="
                         f"{response_tokens} the model's {max_positions} positions leave room for {room}")


def as_real(value) -> numbers.Real | None:
    """`value` if it is a real number, a one-element tensor or array's number (a figure computed with torch or
    numpy), else None."""
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            return None
    return value if isinstance(value, numbers.Real) else None


def reward_value(name: str, value, where: str) -> float:
    """`value` as a float if it is a finite real number (a one-element tensor or array counts as its number; a
    bool does not), else a RewardError naming the reward, what it returned and the row `where` (the advantages
    refuse NaN and infinite rewards)."""
    number = as_real(value)
    if number is not None and not isinstance(number, bool) and math.isfinite(number):
        return float(number)
    raise RewardError(f"reward {name!r} returned {value!r} on {where}, a {type(value).__name__}; a reward must "
                      f"return a finite number (int or float)")
