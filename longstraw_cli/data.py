"""File tasks: prompts and answers from JSONL, JSON or parquet rows, in verl's and TRL's layouts as they are.

- `jsonl`: JSON Lines read here; every row is checked at start (an error names the file and line) and read again
  from the file when served (each row's offset is what is kept); needs no package.
- `dataset`: `datasets.load_dataset("json" | "parquet", data_files=path)` (`pip install longstraw[data]`): rows
  stay in Arrow's memory-mapped files and are read one at a time; the columns are checked at start, a row when
  it is read (an error names the file and row).

A row's prompt is `task.prompt_key` (a dotted path; "prompt"), a string or chat messages; its answer is
`task.answer_key` (dotted: verl's "reward_model.ground_truth"), by default the first of ANSWER_KEYS that the
first row has, else none (a TRL row: its reward reads the columns). Every column but the prompt goes to
`Example.meta`, where the verl and TRL reward adapters find `data_source`, `extra_info`, the answer column and
the rest (rl/reward_adapters.py).

Order: index i is position i % N of epoch i // N. With `shuffle` every epoch has its own order, drawn from
(seed, epoch), so example i is the same whether or not examples 0..i-1 were drawn: a resumed run asks for
example i directly.

Given responses (rollout=data, `TaskConfig.given_responses`): an example is a GROUP, every row with the same
prompt (text, or messages compared as JSON) in file order, so N counts prompts. A row's `task.response_key`
(default: the first of RESPONSE_KEYS the first row has) holds one response or a list of them, each text, one
assistant message or token ids; `task.reward_key` (default: the first of REWARD_KEYS, or none)
a number or one per response; `task.logprob_key` (no default) per response its tokens' old log-probs. They reach the
rollout as `Example.given` (rollout/given.py tokenizes them); the example's other columns are its first row's.
Grouping reads every row's prompt once at start, for `dataset` too.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import math
import numbers
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from longstraw_cli.rl.task_base import Example, GivenResponses, Task, TaskConfig, check_index, register_task
from longstraw_cli.tokenizer import Tokenizer

# where an answer is looked for when task.answer_key is unset: ours, verl's, TRL's math sets, others
ANSWER_KEYS = ("answer", "reward_model.ground_truth", "solution", "ground_truth")
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# where the responses and their rewards are looked for (rollout=data) when task.response_key / reward_key are unset:
# ours (one row a prompt, its responses a list), TRL's prompt-completion rows (one row a response), others
RESPONSE_KEYS = ("responses", "completion", "completions", "response")
REWARD_KEYS = ("rewards", "reward")


def lookup(row: dict, dotted: str) -> Any:
    """row["a"]["b"] for "a.b"; KeyError(dotted) when a part is missing."""
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _has(row: dict, dotted: str) -> bool:
    try:
        return lookup(row, dotted) is not None
    except KeyError:
        return False


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def _check_prompt(prompt: Any, key: str, where: str) -> None:
    if not (isinstance(prompt, str) or _is_messages(prompt)):
        raise ValueError(f"{where}: {key!r} must be a string or a list of chat messages "
                         f"[{{'role': str, 'content': str}}, ...], got {str(prompt)[:80]}")


def is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)


def _is_response(value: Any) -> bool:
    return isinstance(value, str) or _is_messages(value) or is_ids(value)


def _is_empty(response: Any) -> bool:
    return response == "" or (_is_messages(response) and all(m["content"] == "" for m in response))


def _finite(values: Any) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def _responses(value: Any, key: str, where: str) -> list:
    """A row's response column as a list: one response (text, messages or ids) or a list of them."""
    responses = [value] if _is_response(value) else value
    if not isinstance(responses, list) or not responses or not all(map(_is_response, responses)):
        raise ValueError(f"{where}: {key!r} must be a response (text, chat messages [{{'role': str, 'content': "
                         f"str}}, ...] or token ids) or a list of them, got {str(value)[:80]}")
    for n, response in enumerate(responses):
        if _is_empty(response):
            raise ValueError(f"{where}: {key!r} response {n} is empty")
        # a response is the policy's one turn: a user's or a tool's turn among it would be trained as the policy's
        if _is_messages(response) and [m["role"] for m in response] != ["assistant"]:
            raise ValueError(f"{where}: {key!r} response {n} is chat messages of roles "
                             f"{[m['role'] for m in response]}; a response is one assistant message")
    return responses


def _rewards(value: Any, count: int, key: str, where: str) -> list[float]:
    """A row's rewards: a number (one response) or a list of `count` numbers, each finite."""
    values = [value] if count == 1 and not isinstance(value, list) else value
    if not _finite(values) or len(values) != count:
        raise ValueError(f"{where}: {key!r} must give {count} finite number{'s' * (count > 1)}, one per response, "
                         f"got {str(value)[:80]}")
    return [float(v) for v in values]


def _logprob_lists(value: Any, count: int, key: str, where: str) -> list[tuple[float, ...]]:
    """A row's old log-probs: per response a list of finite numbers (for one response, the list itself)."""
    lists = [value] if count == 1 and _finite(value) else value
    if not isinstance(lists, list) or len(lists) != count or not all(map(_finite, lists)):
        raise ValueError(f"{where}: {key!r} must give {count} list{'s' * (count > 1)} of finite log-probs, one per "
                         f"response, got {str(value)[:80]}")
    return [tuple(map(float, v)) for v in lists]


class FileTask(Task):
    """Rows of a file by index (see the module doc); subclasses read the rows and say where row j is."""

    uses_prompt_tokens = False

    def __init__(self, cfg: TaskConfig, tokenizer: Tokenizer):
        super().__init__(cfg, tokenizer)
        if cfg.path is None:
            raise ValueError(f"task {self.name!r} needs path=<file>")
        self.path = Path(cfg.path)
        if not self.path.is_file():
            raise ValueError(f"task {self.name!r}: no such file {str(self.path)!r}")
        self.rows = self._read()
        if len(self.rows) == 0:
            raise ValueError(f"task {self.name!r}: {str(self.path)!r} has no rows")
        first = self.rows[0]
        self.answer_key = cfg.answer_key or next((k for k in ANSWER_KEYS if _has(first, k)), None)
        # rollout=data: the rows of each prompt (one group an example); None: an example is a row
        self.groups: list[list[int]] | None = None
        if cfg.given_responses:
            self.response_key = cfg.response_key or next((k for k in RESPONSE_KEYS if _has(first, k)), None)
            if self.response_key is None:
                raise ValueError(f"{self._where(0)}: rollout=data reads responses, but the row has none of "
                                 f"{list(RESPONSE_KEYS)} (task.response_key names the column); it has {sorted(first)}")
            # task.reward computes the rewards: the file's are not read
            self.reward_key = None if not cfg.given_rewards else (
                cfg.reward_key or next((k for k in REWARD_KEYS if _has(first, k)), None))
            self.groups = self._group()
        self.num_examples = len(self)
        self._order: tuple[int, list[int]] | None = None

    def _read(self):
        raise NotImplementedError

    def _where(self, j: int) -> str:
        return f"{self.path} row {j}"

    def _checked_at_start(self) -> range:
        return range(len(self))

    def examples_checked_at_start(self) -> Iterator[Example]:
        """The examples checked at start, built (so checked) as they are drawn: the trainer draws them once, with
        their prompts' and given responses' tokens (a second pass would read a jsonl file again)."""
        return (self.group_example(k) for k in self._checked_at_start())

    def __len__(self) -> int:
        return len(self.rows) if self.groups is None else len(self.groups)

    def row_index(self, i: int) -> int:
        """The row (the group, with given responses) behind example i."""
        epoch, position = divmod(check_index(i), len(self))
        if not self.cfg.shuffle:
            return position
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self)))
            random.Random(f"{self.name}:{self.cfg.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1][position]

    def example(self, i: int) -> Example:
        return self.group_example(self.row_index(i))

    def _prompt(self, row: dict, where: str) -> Any:
        prompt = self._column(row, self.cfg.prompt_key, "task.prompt_key", where)
        _check_prompt(prompt, self.cfg.prompt_key, where)
        return prompt

    def _prompt_rows(self):
        """Every row, as far as its prompt is concerned (`dataset` reads the prompt's column alone)."""
        return self.rows

    def _group(self) -> list[list[int]]:
        """The rows of each prompt, in the order prompts first appear; a digest of each prompt is what is kept."""
        groups: dict[bytes, list[int]] = {}
        for j, row in enumerate(self._prompt_rows()):
            prompt = self._prompt(dict(row), self._where(j))
            digest = hashlib.sha256(json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode()).digest()
            groups.setdefault(digest, []).append(j)
        return list(groups.values())

    def group_example(self, k: int) -> Example:
        """Example k: row k, or with given responses the first row of group k, its responses collected."""
        if self.groups is None:
            return self.row_example(k)
        rows = self.groups[k]
        # each row read once (a jsonl row is parsed from the file): the first one's columns make the example
        read = [dict(self.rows[j]) for j in rows]
        example = self.row_example(rows[0], read[0])
        responses, where, rewards, logprobs = [], [], [], []
        for j, row in zip(rows, read):
            at = self._where(j)
            mine = _responses(self._column(row, self.response_key, "task.response_key", at), self.response_key, at)
            responses += mine
            where += [at] if len(mine) == 1 else [f"{at} response {n}" for n in range(len(mine))]
            if self.reward_key is not None:
                value = self._column(row, self.reward_key, "task.reward_key", at)
                rewards += _rewards(value, len(mine), self.reward_key, at)
            if self.cfg.logprob_key is not None:
                value = self._column(row, self.cfg.logprob_key, "task.logprob_key", at)
                logprobs += _logprob_lists(value, len(mine), self.cfg.logprob_key, at)
        given = GivenResponses(tuple(responses), tuple(where), tuple(rewards) if self.reward_key else None,
                               tuple(logprobs) if self.cfg.logprob_key else None)
        # the given columns are the rollout's, not the reward's: a reward reads the decoded responses
        meta = {k: v for k, v in example.meta.items()
                if k not in (self.response_key, self.reward_key, self.cfg.logprob_key)}
        return dataclasses.replace(example, meta=meta, given=given)

    @staticmethod
    def _column(row: dict, key: str, setting: str, where: str) -> Any:
        try:
            return lookup(row, key)
        except KeyError:
            raise ValueError(f"{where}: missing field {key!r} ({setting}); the row has {sorted(row)}") from None

    def row_example(self, j: int, row: dict | None = None) -> Example:
        """Example of row j (`row`: that row as already read)."""
        row, where, cfg = dict(self.rows[j]) if row is None else row, self._where(j), self.cfg
        prompt = self._prompt(row, where)
        answer = ""
        ground_truth = None
        if self.answer_key is not None:
            ground_truth = self._column(row, self.answer_key, "task.answer_key", where)
            if ground_truth is None or isinstance(ground_truth, bool):
                raise ValueError(f"{where}: {self.answer_key!r} must be a string, a number or a list, got "
                                 f"{ground_truth!r}")
            answer = ground_truth if isinstance(ground_truth, str) else (
                str(ground_truth) if isinstance(ground_truth, (int, float)) else json.dumps(ground_truth))
        meta = {k: v for k, v in row.items() if k != cfg.prompt_key}
        return Example(prompt, answer, meta, ground_truth=ground_truth, where=where)


class JsonlRows:
    """A JSON Lines file's rows by index, parsed when asked for: what is kept is each row's byte offset and line
    number (16 bytes a row), so a file of long responses and their log-probs is not held in memory on every rank.
    A row that is not UTF-8, not JSON or not an object raises a ValueError naming its file and line."""

    def __init__(self, path: Path):
        self.path, self._file = path, None
        self.offsets, self.lines = array.array("q"), array.array("q")
        with path.open("rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    self.offsets.append(offset)
                    self.lines.append(lineno)
                offset += len(raw)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, j: int) -> dict:
        if self._file is None:  # one handle, opened on first use (the checks at start read every row)
            self._file = self.path.open("rb")
        self._file.seek(self.offsets[j])
        return self._parse(self._file.readline(), f"{self.path}:{self.lines[j]}")

    @staticmethod
    def _parse(raw: bytes, where: str) -> dict:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 ({e.reason})") from None
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        return row

    def __iter__(self) -> Iterator[dict]:
        return (self[j] for j in range(len(self)))

    def __del__(self):
        if self._file is not None:
            self._file.close()


@register_task("jsonl")
class Jsonl(FileTask):
    """JSON Lines, checked here: a bad row stops the run at start with its file and line. Rows are read from the
    file when served (`JsonlRows`)."""

    def _read(self) -> JsonlRows:
        if FORMATS.get(self.path.suffix) == "parquet":
            raise ValueError(f"task 'jsonl' reads JSON Lines; {str(self.path)!r} is parquet: use task=dataset")
        return JsonlRows(self.path)

    def _where(self, j: int) -> str:
        return f"{self.path}:{self.rows.lines[j]}"


@register_task("dataset")
class HFDataset(FileTask):
    """A JSON, JSON Lines or parquet file through Hugging Face `datasets` (task.format, or the file's extension)."""

    def _read(self):
        fmt = self.cfg.format or FORMATS.get(self.path.suffix)
        if fmt not in ("json", "parquet"):
            raise ValueError(f"task 'dataset': cannot tell the format of {str(self.path)!r}; set task.format to "
                             f"json or parquet (by extension: {FORMATS})")
        try:
            import datasets
        except ImportError as e:
            raise ImportError("task 'dataset' reads files through Hugging Face datasets: pip install "
                              "longstraw[data] (task=jsonl reads JSON Lines without it)") from e
        datasets.disable_progress_bars()
        try:
            return datasets.load_dataset(fmt, data_files=str(self.path), split="train")
        except Exception as e:  # noqa: BLE001 - datasets' errors vary by format; the user needs file and cause
            cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"task 'dataset': cannot read {str(self.path)!r} as {fmt} "
                             f"({type(e).__name__}: {cause})") from None

    def _checked_at_start(self) -> range:
        # a million-row file is not read whole at start: the first row fixes the columns, the others are
        # checked as they are served
        return range(1)

    def _prompt_rows(self):
        return self.rows.select_columns([self.cfg.prompt_key.split(".")[0]])
