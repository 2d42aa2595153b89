"""Tasks: where prompts and reference answers come from.

A task turns an index i into an `Example(prompt, answer, meta)`. Tasks are registered by name and built from
their own `TaskConfig` plus a tokenizer (`make_task(cfg, tokenizer)`).

Synthetic long-context tasks (`passkey`, `kv_retrieval`, `variable_tracking`, `char_choice`) hide needles in
filler and are generated at `cfg.prompt_tokens` tokens of the given tokenizer: the prompt comes out at exactly
that length for the byte tokenizer, and at most a few tokens below it for a subword tokenizer. Everything in
example i is drawn from RNGs seeded by (task name, seed, i), so example i is the same whether or not examples
0..i-1 were drawn: a resumed run asks for example i directly.

Simplifications, stated once:
- Filler is word salad from a fixed lower-case vocabulary with no digits, so it never looks like a needle.
- Prompts are plain text: no chat template, and length is `len(tokenizer.encode(prompt))` without special
  tokens. A trainer that adds a template or BOS adds those tokens on top.
- Fitting the length tokenizes the whole prompt a few times (about three for a subword tokenizer, once for
  bytes); with a subword tokenizer and million-token prompts that costs seconds per example.
- File tasks (`jsonl`, `dataset`: data.py) serve rows as written, with no length control: `prompt_tokens`
  does not apply to them.
"""

from __future__ import annotations

import functools
import math
import random
import string
from collections.abc import Callable

# the file tasks (jsonl, dataset): importing data.py registers them
from longstraw_cli import data  # noqa: F401
from longstraw_cli.rl.task_base import TASKS, Example, Task, TaskConfig, check_index, register_task
from longstraw_cli.tokenizer import Tokenizer


def get_task(name: str) -> type[Task]:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]


def make_task(cfg: TaskConfig, tokenizer: Tokenizer) -> Task:
    return get_task(cfg.name)(cfg, tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# Filler and length fitting

_WORDS = tuple(
    """the a of and to in is was for on with as by at from that this it his her their its be are were has had
    have not but or which one all would there when who will more no if out so up said what about into than them
    can only other new some could time these two may then do first any my now such like our over man me even most
    made after also did many before must through back years where much your way well down should because each just
    those people how too little state good very make world still own see men work long get here between both life
    being under never day same another know while last might us great old year off come since against go came
    right used take three house river stone garden window morning evening summer winter market letter road
    village forest mountain valley harbor lantern kettle meadow orchard bridge candle ribbon pebble thunder
    whisper shadow silver golden quiet gentle bright narrow distant ancient patient hollow""".split()
)


class _Filler:
    """A deterministic stream of filler sentences; `text(n)` is always the same first n characters."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self._text = ""

    def text(self, n: int) -> str:
        if n > len(self._text):
            # Grow geometrically so a search over n re-generates little.
            need = max(n - len(self._text), len(self._text) // 2, 4096)
            parts, size = [], 0
            while size < need:
                sentence = " ".join(self._rng.choices(_WORDS, k=self._rng.randint(6, 14))).capitalize() + ". "
                parts.append(sentence)
                size += len(sentence)
            self._text += "".join(parts)
        return self._text[:n]


def _insert(filler: str, needles: list[tuple[float, str]]) -> str:
    """Put each needle at the last sentence start at or before its depth (a fraction); needles keep their order."""
    pieces, prev = [], 0
    for depth, needle in sorted(needles, key=lambda t: t[0]):
        end = filler.rfind(". ", prev, int(depth * len(filler)))
        at = prev if end < 0 else end + 2
        pieces += [filler[prev:at], needle]
        prev = at
    pieces.append(filler[prev:])
    return "".join(pieces)


def _fit(
    render: Callable[[int], str], tokenizer: Tokenizer, target: int, task: str, tokens_per_unit: float = 1.0
) -> tuple[int, int]:
    """The largest n with `render(n)` at most `target` tokens, and its token count.

    The first guess takes `tokens_per_unit` tokens per unit of n; a couple of secant steps (tokens per unit
    measured on this very prompt) land next to the answer, and bisection finishes. Token count grows with n but
    not additively under subword tokenizers, hence the search.
    """

    def count(n: int) -> int:
        return len(tokenizer.encode(render(n)))

    base = count(0)
    if base > target:
        raise ValueError(f"task {task!r}: prompt_tokens={target} is too small; its fixed text alone is {base} tokens")
    if base == target:
        return 0, base
    lo, lo_count, hi = 0, base, None  # invariant: count(lo) <= target < count(hi)
    rate = max(tokens_per_unit, 1e-3)
    n = int((target - base) / rate)
    for step in range(64):
        n = max(n, lo + 1) if hi is None else min(max(n, lo + 1), hi - 1)
        if n <= lo:
            break
        c = count(n)
        if c == target:
            return n, c
        if c < target:
            lo, lo_count = n, c
        else:
            hi = n
        if c > base:
            rate = (c - base) / n
        if hi is None or step < 4:
            n += math.floor((target - c) / rate)
        else:
            n = (lo + hi) // 2
    return lo, lo_count


class _Synthetic(Task):
    """A prompt of `cfg.prompt_tokens` tokens: subclasses return `render(n)` for n filler characters."""

    def _build(self, rng: Callable[[str], random.Random]) -> tuple[Callable[[int], str], str, dict]:
        raise NotImplementedError

    @functools.cached_property
    def _filler_rate(self) -> float:
        """Tokens per filler character: a good first guess saves re-tokenizing a long prompt."""
        sample = _Filler(random.Random(0)).text(8192)
        return max(len(self.tokenizer.encode(sample)) / len(sample), 1e-3)

    def example(self, i: int) -> Example:
        i = check_index(i)
        key = f"{self.name}:{self.cfg.seed}:{i}"
        render, answer, meta = self._build(lambda stream: random.Random(f"{key}:{stream}"))
        n, num_tokens = _fit(render, self.tokenizer, self.cfg.prompt_tokens, self.name, self._filler_rate)
        return Example(render(n), answer, {**meta, "index": i, "prompt_tokens": num_tokens, "filler_chars": n})


@register_task("passkey")
class Passkey(_Synthetic):
    """A number of `passkey_digits` digits hidden at a random depth; the answer is the number."""

    def _build(self, rng):
        r = rng("needle")
        passkey = str(r.randint(1, 9)) + "".join(r.choices(string.digits, k=self.cfg.passkey_digits - 1))
        depth = r.random()
        filler = _Filler(rng("filler"))
        head = "There is a passkey hidden in the text below. Find it and remember it.\n\n"
        needle = f"The passkey is {passkey}. Remember it. {passkey} is the passkey. "
        tail = "\n\nWhat is the passkey? Answer with the passkey only.\nAnswer:"

        def render(n: int) -> str:
            return head + _insert(filler.text(n), [(depth, needle)]) + tail

        return render, passkey, {"depth": depth}


class _HexWords:
    """Distinct 8-digit hex strings; `lines(k)` is always the same first k 'key: value' lines."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self._seen: set[str] = set()
        self._lines: list[str] = []

    def fresh(self) -> str:
        while True:
            word = f"{self._rng.getrandbits(32):08x}"
            if word not in self._seen:
                self._seen.add(word)
                return word

    def lines(self, k: int) -> list[str]:
        while len(self._lines) < k:
            self._lines.append(f"{self.fresh()}: {self.fresh()}\n")
        return self._lines[:k]


@register_task("kv_retrieval")
class KVRetrieval(_Synthetic):
    """Lines 'key: value' of distinct 8-digit hex words fill the prompt; the answer is the value of one key."""

    def _build(self, rng):
        words = _HexWords(rng("pairs"))
        key, value = words.fresh(), words.fresh()
        depth = rng("needle").random()
        filler = _Filler(rng("filler"))
        record = f"{key}: {value}\n"
        head = "Below is a list of records, one 'key: value' per line. Remember them.\n\n"
        tail = f"\nWhat is the value of key {key}? Answer with the value only.\nAnswer:"

        def render_records(num_lines: int, pad: int = 0) -> str:
            lines = words.lines(num_lines)
            at = int(depth * (num_lines + 1))
            pad_line = filler.text(pad - 1) + "\n" if pad else ""
            return head + pad_line + "".join(lines[:at]) + record + "".join(lines[at:]) + tail

        # As many records as fit, then a line of filler to fill the last few tokens; one variable would leave
        # a gap of up to a record's worth of tokens.
        per_record = len(self.tokenizer.encode(record))
        num_lines, _ = _fit(render_records, self.tokenizer, self.cfg.prompt_tokens, self.name, per_record)

        def render(n: int) -> str:
            return render_records(num_lines, n)

        return render, value, {"depth": depth, "key": key, "records": num_lines + 1}


@register_task("variable_tracking")
class VariableTracking(_Synthetic):
    """Chains 'VAR B = VAR A' hidden in filler; the answer is every variable of the first chain, sorted.

    The answer is the names in alphabetical order, space-separated: `exact` checks it as written, the default
    `unordered_words` accepts any order.
    """

    default_reward = "unordered_words"

    def _build(self, rng):
        r = rng("needle")
        num_chains, length = self.cfg.num_chains, self.cfg.chain_length
        names: list[str] = []
        while len(names) < num_chains * length:
            name = "".join(r.choices(string.ascii_uppercase, k=5))
            if name not in names:
                names.append(name)
        values: list[str] = []
        while len(values) < num_chains:
            value = str(r.randint(10000, 99999))
            if value not in values:
                values.append(value)
        needles = []
        for c in range(num_chains):
            chain = names[c * length : (c + 1) * length]
            statements = [f"VAR {chain[0]} = {values[c]}. "]
            statements += [f"VAR {b} = VAR {a}. " for a, b in zip(chain, chain[1:])]
            # Sorted depths keep a chain's statements in order; `_insert`'s sort is stable on ties.
            needles += zip(sorted(r.random() for _ in statements), statements)
        filler = _Filler(rng("filler"))
        head = "Track the VAR assignments in the text below.\n\n"
        tail = f"\n\nWhich variables equal {values[0]}? Answer with their names, sorted and space-separated.\nAnswer:"

        def render(n: int) -> str:
            return head + _insert(filler.text(n), needles) + tail

        return render, " ".join(sorted(names[:length])), {"value": values[0]}


@register_task("char_choice")
class CharChoice(_Synthetic):
    """For learning tests on tiny random models: 'pick one of abcd', and `cfg.target` always wins.

    The prompt offers `cfg.alphabet` but never says which letter is right; the answer is `cfg.target` for every
    example, so the policy can only learn it from reward. A random byte-level model starts its response with
    the target about once in 256 samples (`prefix`, the default); the reward `char_rate` (share of response
    characters equal to the target) gives a denser signal when groups are small.
    """

    default_reward = "prefix"

    def _build(self, rng):
        filler = _Filler(rng("filler"))
        tail = f"\nPick one of {self.cfg.alphabet}:"

        def render(n: int) -> str:
            return filler.text(n) + tail

        return render, self.cfg.target, {}

