"""Checks of the run's data that the config cannot make: at load, not at step N.

- `check_prompts`: every prompt of a task with a fixed number of examples (jsonl) is tokenized once at start, the
  way the trainer will; an empty one, or one that leaves no room for response_tokens within the model's positions,
  stops the run before any work with one line naming the row. Synthetic tasks are sized by prompt_tokens, which
  the config checks.
- `reward_value`: a reward must return a finite number; anything else stops the run with one line naming the reward.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

from longstraw_cli.errors import RunError
from longstraw_cli.rl.tasks import Example, Task


class InputError(RunError, ValueError):
    """A prompt or a reward's value the run cannot use (exit status 2)."""


def check_prompts(task: Task, prompt_ids: Callable[[Example], Sequence[int]], max_positions: int,
                  response_tokens: int) -> None:
    """Raises InputError for the first prompt of `task` that is empty or longer than max_positions - response_tokens."""
    if task.num_examples is None:
        return
    room = max_positions - response_tokens
    for i in range(task.num_examples):
        num_tokens = len(prompt_ids(task.example(i)))
        if num_tokens == 0:
            raise InputError(f"{task.where(i)}: the prompt is empty (0 tokens)")
        if num_tokens > room:
            raise InputError(f"{task.where(i)}: the prompt is {num_tokens} tokens; with response_tokens="
                             f"{response_tokens} the model's {max_positions} positions leave room for {room}")


def reward_value(name: str, value) -> float:
    """`value` as a float if it is a finite real number, else an InputError naming the reward and what it returned
    (the advantages refuse NaN and infinite rewards)."""
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    raise InputError(f"reward {name!r} returned {value!r} ({type(value).__name__}); a reward must return a finite "
                     f"number (int or float)")
