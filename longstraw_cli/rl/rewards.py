"""Rewards: `fn(response, example) -> float`, registered by name or given as 'package.module:function'.

`response` is the decoded completion exactly as the trainer passes it; nothing here strips chat markup or
thinking blocks. Every built-in reward is 0.0 or 1.0 except `char_rate`, a share in [0, 1].
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable

from longstraw_cli.rl.tasks import Example

RewardFn = Callable[[str, Example], float]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def register(fn: RewardFn) -> RewardFn:
        assert name not in _REWARDS, f"reward {name!r} registered twice"
        _REWARDS[name] = fn
        return fn

    return register


def get_reward(spec: str) -> RewardFn:
    """A registered reward by name, or any callable named 'package.module:function'."""
    if ":" not in spec:
        if spec not in _REWARDS:
            raise ValueError(
                f"unknown reward {spec!r}; choose one of {sorted(_REWARDS)}, or give 'package.module:function'"
            )
        return _REWARDS[spec]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({e})") from e
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return obj


@register_reward("exact")
def exact(response: str, example: Example) -> float:
    """The whole response, stripped, equals the answer."""
    return float(response.strip() == example.answer.strip())


@register_reward("exact_line")
def exact_line(response: str, example: Example) -> float:
    """The first non-empty line of the response, stripped, equals the answer; later lines are ignored."""
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    return float(bool(lines) and lines[0] == example.answer.strip())


@register_reward("exact_word")
def exact_word(response: str, example: Example) -> float:
    """The first whitespace-separated word of the response equals the answer."""
    words = response.split()
    return float(bool(words) and words[0] == example.answer.strip())


@register_reward("contains")
def contains(response: str, example: Example) -> float:
    answer = example.answer.strip()
    return float(bool(answer) and answer in response)


@register_reward("prefix")
def prefix(response: str, example: Example) -> float:
    """The stripped response starts with the answer."""
    answer = example.answer.strip()
    return float(bool(answer) and response.strip().startswith(answer))


def _words(text: str) -> list[str]:
    return sorted(w for w in re.split(r"[\s,]+", text.strip()) if w)


@register_reward("unordered_words")
def unordered_words(response: str, example: Example) -> float:
    """Same words as the answer in any order (split on whitespace and commas; repeats count)."""
    return float(_words(response) == _words(example.answer))


@register_reward("char_rate")
def char_rate(response: str, example: Example) -> float:
    """Share of the response's characters equal to a one-character answer: a dense signal for tiny models."""
    target = example.answer.strip()
    if len(target) != 1:
        raise ValueError(f"reward 'char_rate' needs a one-character answer, got {example.answer!r}")
    return response.count(target) / len(response) if response else 0.0


@register_reward("math")
def math_equal(response: str, example: Example) -> float:
    """Mathematical equivalence by math-verify: '1/2', '0.5' and '\\frac{1}{2}' agree; \\boxed{} is found."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ImportError("reward 'math' needs math-verify: pip install longstraw[math]") from e
    # math-verify times out with signal.alarm, which works only on the main thread; elsewhere it would fail.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(example.answer, parsing_timeout=timeout)
    pred = parse(response, parsing_timeout=timeout)
    return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout))
