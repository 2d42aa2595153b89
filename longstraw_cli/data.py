"""File tasks: prompts and answers from JSONL, JSON or parquet rows, in verl's and TRL's layouts as they are.

- `jsonl`: JSON Lines read here; every row is checked at start (an error names the file and line); needs no
  package.
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
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from longstraw_cli.rl.task_base import Example, Task, TaskConfig, check_index, register_task
from longstraw_cli.tokenizer import Tokenizer

# where an answer is looked for when task.answer_key is unset: ours, verl's, TRL's math sets, others
ANSWER_KEYS = ("answer", "reward_model.ground_truth", "solution", "ground_truth")
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


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


def _check_prompt(prompt: Any, key: str, where: str) -> None:
    if isinstance(prompt, str):
        return
    messages = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    if not messages:
        raise ValueError(f"{where}: {key!r} must be a string or a list of chat messages "
                         f"[{{'role': str, 'content': str}}, ...], got {str(prompt)[:80]}")


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
        self.num_examples = len(self.rows)
        first = self.rows[0]
        self.answer_key = cfg.answer_key or next((k for k in ANSWER_KEYS if _has(first, k)), None)
        self._order: tuple[int, list[int]] | None = None
        for j in self._checked_at_start():
            self.row_example(j)

    def _read(self):
        raise NotImplementedError

    def _where(self, j: int) -> str:
        return f"{self.path} row {j}"

    def _checked_at_start(self) -> range:
        return range(len(self.rows))

    def examples_checked_at_start(self) -> Iterator[Example]:
        return (self.row_example(j) for j in self._checked_at_start())

    def __len__(self) -> int:
        return len(self.rows)

    def row_index(self, i: int) -> int:
        """The row behind example i."""
        epoch, position = divmod(check_index(i), len(self.rows))
        if not self.cfg.shuffle:
            return position
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(f"{self.name}:{self.cfg.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1][position]

    def example(self, i: int) -> Example:
        return self.row_example(self.row_index(i))

    def row_example(self, j: int) -> Example:
        row, where, cfg = dict(self.rows[j]), self._where(j), self.cfg
        try:
            prompt = lookup(row, cfg.prompt_key)
        except KeyError:
            raise ValueError(f"{where}: missing field {cfg.prompt_key!r} (task.prompt_key); the row has "
                             f"{sorted(row)}") from None
        _check_prompt(prompt, cfg.prompt_key, where)
        answer = ""
        ground_truth = None
        if self.answer_key is not None:
            try:
                ground_truth = lookup(row, self.answer_key)
            except KeyError:
                raise ValueError(f"{where}: missing field {self.answer_key!r} (task.answer_key); the row has "
                                 f"{sorted(row)}") from None
            if ground_truth is None or isinstance(ground_truth, bool):
                raise ValueError(f"{where}: {self.answer_key!r} must be a string, a number or a list, got "
                                 f"{ground_truth!r}")
            answer = ground_truth if isinstance(ground_truth, str) else (
                str(ground_truth) if isinstance(ground_truth, (int, float)) else json.dumps(ground_truth))
        meta = {k: v for k, v in row.items() if k != cfg.prompt_key}
        return Example(prompt, answer, meta, ground_truth=ground_truth, where=where)


@register_task("jsonl")
class Jsonl(FileTask):
    """JSON Lines, read and checked here: a bad row stops the run at start with its file and line."""

    def _read(self) -> list[dict]:
        if FORMATS.get(self.path.suffix) == "parquet":
            raise ValueError(f"task 'jsonl' reads JSON Lines; {str(self.path)!r} is parquet: use task=dataset")
        self.lines, rows = [], []
        with self.path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                where = f"{self.path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{where}: not UTF-8 ({e.reason})") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
                self.lines.append(lineno)
        return rows

    def _where(self, j: int) -> str:
        return f"{self.path}:{self.lines[j]}"


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
