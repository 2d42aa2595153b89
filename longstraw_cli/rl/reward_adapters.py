"""How a reward is called: the native, verl and TRL signatures, each checked at start and called on a whole group.

The trainer asks one thing of a reward: the G rewards of one prompt's G decoded responses
(`GroupReward(example, responses, response_ids) -> list[float]`). Each style is a small registered adapter:

- `native`: `fn(response: str, example: Example) -> float`, once per response (rl/rewards.py's built-ins).
- `verl`: `compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}`,
  once per response, by keyword, as verl's reward manager calls it: `data_source` and `extra_info` are the row's
  columns, `ground_truth` the answer as the row holds it. The dict's other keys with a number (or a bool) are the
  step's `reward/<key>` metrics (their mean over the responses that gave them), as verl logs them; a key with
  anything else is named once in a warning and not logged.
- `trl`: `reward_func(prompts, completions, **kwargs) -> list[float]`, once per group, as TRL's GRPOTrainer
  calls it: G copies of the prompt, the G completions (for a prompt of chat messages, each completion is
  `[{"role": "assistant", "content": text}]`), `completion_ids`, and every other column of the row repeated G
  times as a keyword argument.

`auto` picks by parameter names (`solution_str`: verl; `completions`: trl; else native). A function that does not
take `**kwargs` is given only the keywords it names. The check at start binds the call to the task's first
example, so a wrong signature is one line before the model is built. A reward that raises, returns anything but
a finite number (inputs.reward_value, whatever the style) or the wrong count stops the run with one line naming
the reward and the row (`RewardError`, exit status 2): rewards come before any gradient, so nothing of that step
is written (no metrics row, no checkpoint).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from longstraw_cli.rl.rewards import get_reward
from longstraw_cli.rl.tasks import Example
from longstraw_cli.safety.inputs import RewardError, as_real, reward_value

log = logging.getLogger("longstraw")


@dataclass(frozen=True)
class Style:
    # the keyword arguments (or positional, for native) a probe call binds, to check the signature at start
    probe: Callable[[Example], tuple[tuple, dict]]
    # (fn, example, responses, response_ids) -> raw values, one per response
    call: Callable[[Callable, Example, Sequence[str], Sequence[list[int]]], list]
    signature: str


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """kwargs cut to the names fn takes, unless it takes **kwargs."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def _verl_kwargs(example: Example, response: str) -> dict:
    truth = example.answer if example.ground_truth is None else example.ground_truth
    return {"data_source": example.meta.get("data_source"), "solution_str": response, "ground_truth": truth,
            "extra_info": example.meta.get("extra_info")}


def _trl_kwargs(example: Example, responses: Sequence[str], response_ids: Sequence[list[int]]) -> dict:
    g = len(responses)
    chat = not isinstance(example.prompt, str)
    completions = [[{"role": "assistant", "content": r}] for r in responses] if chat else list(responses)
    columns = {k: [v] * g for k, v in example.meta.items() if k not in ("prompts", "completions")}
    return {**columns, "prompts": [example.prompt] * g, "completions": completions,
            "completion_ids": [list(ids) for ids in response_ids]}


STYLES: dict[str, Style] = {
    "native": Style(
        probe=lambda ex: (("", ex), {}),
        call=lambda fn, ex, responses, ids: [fn(r, ex) for r in responses],
        signature="fn(response, example) -> float"),
    "verl": Style(
        probe=lambda ex: ((), _verl_kwargs(ex, "")),
        call=lambda fn, ex, responses, ids: [fn(**_accepted(fn, _verl_kwargs(ex, r))) for r in responses],
        signature="compute_score(data_source, solution_str, ground_truth, extra_info) -> float or {'score': ...}"),
    "trl": Style(
        probe=lambda ex: ((), _trl_kwargs(ex, ["", ""], [[], []])),
        call=lambda fn, ex, responses, ids: list(fn(**_accepted(fn, _trl_kwargs(ex, responses, ids)))),
        signature="reward_func(prompts, completions, **kwargs) -> list[float]"),
}
REWARD_STYLES = ("auto", *STYLES)


def _guess_style(fn: Callable) -> str:
    names = set(inspect.signature(fn).parameters)
    return "verl" if "solution_str" in names else "trl" if "completions" in names else "native"


def _score(value, style: str):
    # verl's compute_score may return {"score": ..., other metrics}
    return value.get("score") if style == "verl" and isinstance(value, dict) else value


@dataclass
class Scores:
    """A group's rewards, and for each response the other figures its reward returned (verl's dict keys)."""

    values: list[float]
    extra: list[dict[str, float]] = field(default_factory=list)


class GroupReward:
    """`spec` (a registered name, module:function or file.py:function) called in `style` on a whole group."""

    def __init__(self, spec: str, style: str, probe: Example):
        if style not in REWARD_STYLES:
            raise ValueError(f"task.reward_style={style!r}; valid: {list(REWARD_STYLES)}")
        self.spec, self.fn = spec, get_reward(spec)
        # a verl dict's keys that are not numbers, warned about once each
        self.unlogged: set[str] = set()
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):
            signature = None
        self.style = _guess_style(self.fn) if style == "auto" and signature is not None else (
            "native" if style == "auto" else style)
        if signature is not None:
            args, kwargs = STYLES[self.style].probe(probe)
            if self.style != "native":
                kwargs = _accepted(self.fn, kwargs)
            try:
                signature.bind(*args, **kwargs)
            except TypeError as e:
                columns = f"; the row's columns: {sorted(probe.meta)}" if self.style == "trl" else ""
                raise ValueError(f"reward {spec!r} cannot be called as a {self.style} reward, "
                                 f"{STYLES[self.style].signature} ({e}){columns}") from None

    def __call__(self, example: Example, responses: Sequence[str], response_ids: Sequence[list[int]]) -> list[float]:
        return self.score(example, responses, response_ids).values

    def score(self, example: Example, responses: Sequence[str], response_ids: Sequence[list[int]]) -> Scores:
        row = example.origin
        try:
            values = STYLES[self.style].call(self.fn, example, responses, response_ids)
        except Exception as e:  # noqa: BLE001 - any failure of user code is reported as one line
            raise RewardError(f"reward {self.spec!r} failed on {row}: {type(e).__name__}: {e}") from e
        if len(values) != len(responses):
            raise RewardError(f"reward {self.spec!r} returned {len(values)} values for {len(responses)} responses "
                              f"on {row}")
        return Scores([reward_value(self.spec, _score(v, self.style), row) for v in values],
                      [self._extra(v) for v in values])

    @property
    def gives_extras(self) -> bool:
        """Whether this reward's values may carry extra figures: a verl reward's dict, its keys beside "score"."""
        return self.style == "verl"

    def _extra(self, value) -> dict[str, float]:
        """A verl dict's keys beside "score" whose values are finite numbers (a bool as 0 / 1), as floats."""
        if not self.gives_extras or not isinstance(value, dict):
            return {}
        extra = {}
        for key, v in value.items():
            if key == "score":
                continue
            number = as_real(v)
            if number is not None and math.isfinite(number):
                extra[str(key)] = float(number)
            elif key not in self.unlogged:
                self.unlogged.add(key)
                log.warning("reward %r returns %r = %s, not a finite number: not logged as reward/%s", self.spec,
                            key, _short(v), key)
        return extra


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
