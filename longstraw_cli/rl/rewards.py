"""Rewards: `fn(response, example) -> float`, registered by name, or any function given as 'package.module:function'
(the working directory is importable, as under `python -m`) or 'path/to/file.py:function' (as verl takes it).
How a function is called (native, verl, TRL signatures) is rl/reward_adapters.py's concern.

`response` is the decoded completion exactly as the trainer passes it; nothing here strips chat markup or
thinking blocks. Every built-in reward is 0.0 or 1.0 except `char_rate`, a share in [0, 1].
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from longstraw_cli.rl.tasks import Example

RewardFn = Callable[[str, Example], float]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def register(fn: RewardFn) -> RewardFn:
        assert name not in _REWARDS, f"reward {name!r} registered twice"
        _REWARDS[name] = fn
        return fn

    return register


def _import_file(path: Path, spec: str):
    if not path.is_file():
        raise ValueError(f"reward {spec!r}: no such file {str(path)!r}")
    name = f"longstraw_reward_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    # registered before running it, as an import does: dataclasses and pickling look the module up by name
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"reward {spec!r}: importing {str(path)!r} failed ({type(e).__name__}: {e})") from e
    return module


def _import_module(module_name: str, spec: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        # the `longstraw` script does not put the working directory on the path the way `python -m` does
        if e.name != module_name.partition(".")[0] or cwd in sys.path:
            raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({e})") from e
        sys.path.insert(0, cwd)
        return _import_module(module_name, spec)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({e})") from e


def get_reward(spec: str) -> RewardFn:
    """A registered reward by name, or any callable named 'package.module:function' or 'path/to/file.py:function'."""
    if ":" not in spec:
        if spec not in _REWARDS:
            raise ValueError(
                f"unknown reward {spec!r}; choose one of {sorted(_REWARDS)}, or give 'package.module:function' "
                f"or 'path/to/file.py:function'"
            )
        return _REWARDS[spec]
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        obj = _import_file(Path(module_name), spec)
    else:
        obj = _import_module(module_name, spec)
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: {module_name!r} has no function {attr!r}")
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
