"""Config values against their dataclass field's type, so that a wrong type is one line naming key and value.

Hydra passes values as YAML and its override grammar give them: `resume=no` is the string 'no' (true in a plain
`bool()`), `capture.block_size=1.5` a float, `optim.lr=fast` a string. Checked here: bool (true / false only),
int (not a bool, not a float), float (an int is accepted), str, None, `Literal[...]`, `X | None`, tuples (given
as lists) of those. Nested dataclasses and other types are left to their own checks.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any


def _describe(hint) -> str:
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if hint is type(None):
        return "null"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " or ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(args[0])}"
        return f"a list of {len(args)} {_plural(args[0])}"
    return getattr(hint, "__name__", str(hint))


def _plural(hint) -> str:
    return {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(hint, _describe(hint))


def matches(value: Any, hint) -> bool:
    """Whether `value` (as the composed config gives it) is of type `hint`; types not listed above always match."""
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return not isinstance(value, bool) and value in args
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
    return True


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def mismatch(cls, node: dict, where: str) -> str | None:
    """One line for the first value of `node` that does not match its field of dataclass `cls`, else None."""
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in node and not matches(node[field.name], hints[field.name]):
            key = f"{where}.{field.name}" if where else field.name
            return f"{key}={node[field.name]!r} must be {_describe(hints[field.name])}"
    return None
