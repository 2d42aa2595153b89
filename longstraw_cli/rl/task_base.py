"""What a task is: `Example`, `TaskConfig`, the `Task` base class, and the registry tasks add themselves to by
name. The synthetic tasks (rl/tasks.py) and the file tasks (data.py) both build on these; rl/tasks.py imports both
and looks a task up by name (`make_task`)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from longstraw_cli.tokenizer import Tokenizer, render_prompt, render_response


@dataclass(frozen=True)
class GivenResponses:
    """rollout=data: the responses a file gives for one prompt, from every row with that prompt in file order
    (data.py), before tokenization (rollout/given.py)."""

    # each text, chat messages [{"role": ..., "content": ...}] (the turns after the prompt) or token ids
    responses: tuple
    # where each came from, for messages ("train.jsonl:3", "train.jsonl:4 response 1")
    where: tuple[str, ...]
    # one number per response; None: the task's reward gives them
    rewards: tuple[float, ...] | None = None
    # per response its tokens' old log-probs; None: scored from the resident state
    logprobs: tuple[tuple[float, ...], ...] | None = None


@dataclass(frozen=True)
class Example:
    # text, or chat messages [{"role": ..., "content": ...}] (rendered by the tokenizer's chat template)
    prompt: str | list[dict]
    answer: str
    # the row's other columns (file tasks), or what generated the example (synthetic tasks)
    meta: dict = field(default_factory=dict)
    # the answer as the row holds it (verl's ground_truth may be a list or a number); None: `answer`
    ground_truth: Any = None
    # where the example came from, for error messages ("data.parquet row 17")
    where: str = ""
    # rollout=data: the responses the rows give for this prompt; None elsewhere
    given: GivenResponses | None = None

    @property
    def origin(self) -> str:
        """`where`, or the synthetic example's index: how a message names the example."""
        return self.where or f"example {self.meta.get('index', '?')}"


@dataclass(frozen=True)
class TaskConfig:
    name: str
    prompt_tokens: int = 4096  # synthetic tasks: length of the prompt in tokenizer tokens
    seed: int = 0
    path: str | None = None  # file tasks: the file to read
    # a string prompt goes through the chat template when true; messages always do (false refuses them)
    chat_template: bool | None = None
    chat_template_kwargs: dict | None = None  # passed to the template (e.g. enable_thinking: false)
    # file tasks (data.py): the columns, the order, a validation file
    format: str | None = None  # dataset: json | parquet; None: by the file's extension
    prompt_key: str = "prompt"  # a dotted path into the row
    answer_key: str | None = None  # dotted; None: the first of data.ANSWER_KEYS the first row has, else none
    shuffle: bool = False  # a new seeded order every epoch
    # rollout=data (data.py): the columns of the responses, their rewards and old log-probs (dotted; None: the
    # first of data.RESPONSE_KEYS / REWARD_KEYS the first row has; no log-probs); `given_responses` and
    # `given_rewards` are set by the config, not keys: rows with one prompt form one group (rollout=data), and the
    # file's rewards are read (no task.reward computes them)
    response_key: str | None = None
    reward_key: str | None = None
    logprob_key: str | None = None
    given_responses: bool = False
    given_rewards: bool = True
    val_path: str | None = None  # evaluated every val_every steps: mean reward, logged as val/reward_mean
    val_every: int = 0
    val_examples: int = 0  # 0: every row of val_path
    passkey_digits: int = 5  # passkey
    num_chains: int = 1  # variable_tracking: the first chain is asked about, the others distract
    chain_length: int = 4  # variable_tracking: variables per chain
    alphabet: str = "abcd"  # char_choice: the letters offered in the prompt
    target: str = "a"  # char_choice: the one letter that earns reward

    def __post_init__(self):
        for key in ("val_every", "val_examples"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"task {self.name!r}: {key} must be an integer >= 0, got {value!r}")
        if self.val_every and self.val_path is None:
            raise ValueError(f"task {self.name!r}: val_every={self.val_every} needs val_path=<file>")
        if self.chat_template not in (None, True, False):
            raise ValueError(f"task {self.name!r}: chat_template must be null, true or false, got "
                             f"{self.chat_template!r}")
        for key in ("prompt_tokens", "passkey_digits", "num_chains", "chain_length"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"task {self.name!r}: {key} must be a positive integer, got {value!r}")
        alphabet = self.alphabet
        if not alphabet or len(set(alphabet)) != len(alphabet) or any(c.isspace() for c in alphabet):
            raise ValueError(f"task {self.name!r}: alphabet must be distinct non-space characters, got {alphabet!r}")
        if len(self.target) != 1 or self.target not in alphabet:
            raise ValueError(
                f"task {self.name!r}: target must be one character of alphabet {alphabet!r}, got {self.target!r}"
            )


class Task:
    """Examples by index. `num_examples` is None for synthetic tasks, which are unbounded."""

    name: ClassVar[str]
    default_reward: ClassVar[str] = "exact"
    # synthetic tasks are generated at cfg.prompt_tokens; file tasks serve their rows as written
    uses_prompt_tokens: ClassVar[bool] = True
    num_examples: int | None = None

    def __init__(self, cfg: TaskConfig, tokenizer: Tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer

    def example(self, i: int) -> Example:
        raise NotImplementedError

    def prompt_text(self, example: Example) -> str:
        """The prompt as the model reads it: chat messages through the tokenizer's template."""
        return render_prompt(self.tokenizer, example.prompt, self.cfg.chat_template, self.cfg.chat_template_kwargs)

    def response_text(self, example: Example, response: str | list[dict]) -> str | None:
        """A given response's text as it follows the prompt the model reads (`render_response`): the chat template's
        continuation, or None for a plain-text prompt (the response is its own text)."""
        return render_response(self.tokenizer, example.prompt, response, self.cfg.chat_template,
                               self.cfg.chat_template_kwargs)

    def examples_checked_at_start(self) -> Iterator[Example]:
        """The examples whose prompts the trainer checks before any work (inputs.check_prompts). None here:
        synthetic tasks are generated at prompt_tokens, which the config checks; file tasks name their rows."""
        return iter(())

    def __iter__(self) -> Iterator[Example]:
        indices = itertools.count() if self.num_examples is None else range(self.num_examples)
        return (self.example(i) for i in indices)


TASKS: dict[str, type[Task]] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    def register(cls: type[Task]) -> type[Task]:
        assert name not in TASKS, f"task {name!r} registered twice"
        cls.name = name
        TASKS[name] = cls
        return cls

    return register


def check_index(i: int) -> int:
    try:
        index = operator.index(i)
    except TypeError:
        index = -1
    if index < 0:
        raise ValueError(f"example index must be a non-negative integer, got {i!r}")
    return index
