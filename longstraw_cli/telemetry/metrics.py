"""Per-step metrics: run_dir/metrics.jsonl (the record), a one-line console summary, optionally Weights & Biases
and TensorBoard; and each step's samples (samples.py): run_dir/samples.jsonl, a W&B table, TensorBoard text.

metrics.jsonl holds one JSON object per line, `{"step": step, **metrics}`, each row flushed and fsynced. A
resumed run passes `resume_step` (the first step it will log): rows with step >= resume_step, logged after the
checkpoint by the killed process, are dropped before logging starts, so the resumed file equals the one an
uninterrupted run writes. A fresh run (resume_step None) replaces an existing metrics.jsonl. samples.jsonl is cut
back and replaced alike.

Key conventions the console and `plot_memory` rely on: `time/<phase>` in seconds, `mem/<what>` in bytes. The
console line fits the terminal's width: the step, its headline figures (reward, loss, the step's time summed over
its phases, its peak memory, ...), the least telling dropped first where the line is too long; metrics.jsonl has
them all.
Only rank 0 logs; on other ranks every method is a no-op and nothing is created.

W&B: a fresh run draws a run id and keeps it in run_dir/wandb_run_id; a resumed run opens the same id
(`resume="allow"`), so a killed and resumed run is one W&B run. (Steps the killed process logged after its
last checkpoint are logged again on resume; W&B keeps its first value of a step.) TensorBoard: event files
under run_dir/tensorboard, written with `purge_step` = the first step a resumed run logs, so TensorBoard drops
the killed process's rows past the checkpoint as metrics.jsonl does.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from longstraw_cli.telemetry.samples import COLUMNS as SAMPLE_COLUMNS
from longstraw_cli.telemetry.samples import SAMPLES_FILE
from longstraw_cli.telemetry.samples import extra_columns as sample_extra_columns
from longstraw_cli.telemetry.samples import markdown as samples_markdown

WANDB_MODES = ("offline", "online", "disabled")
BACKENDS = ("console", "jsonl", "wandb", "tensorboard")
METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
TENSORBOARD_DIR = "tensorboard"

@dataclass(frozen=True)
class WandbConfig:
    project: str = "longstraw"
    mode: str = "offline"
    name: str | None = None
    # None: the run directory
    dir: str | None = None

    def __post_init__(self):
        if self.mode not in WANDB_MODES:
            raise ValueError(f"WandbConfig.mode must be one of {', '.join(map(repr, WANDB_MODES))}; got {self.mode!r}")


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl. A torn last line (the process was killed mid-write) is skipped; a bad line
    anywhere else is an error naming the file and line."""
    path = Path(path)
    lines = path.read_text().split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            # the last line has no newline after it only if its write was cut short
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON row ({e})") from e
    return rows


def _to_number(name: str, value):
    if hasattr(value, "item"):  # 0-d tensors and numpy scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"metric {name!r} must be a number, got {type(value).__name__}: {value!r}")
    return value


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _fmt_seconds(v: float) -> str:
    """A time with its unit chosen by size: fast steps are milliseconds, never `0.00s`."""
    if abs(v) >= 1:
        return f"{v:.2f}s"
    if abs(v) >= 1e-3:
        return f"{v * 1e3:.3g}ms"
    return f"{v * 1e6:.3g}us"


def _fmt_value(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:.4g}"


# the console line's figures, in its order, each with the rank it keeps when the line is too long for the
# terminal (0 is dropped last)
_LINE_KEYS = (("reward_mean", 0), ("reward_std", 4), ("val/reward_mean", 1), ("loss", 2), ("nonfinite_steps", 1),
              ("kl_mean", 6), ("grad_norm", 5), ("entropy", 7))
# per-step figures derived from a phase (the rollout's), not phases of their own: not added to the step's time
_DERIVED_TIMES = ("time/decode_step", "time/decode_setup")


def _line_fields(step: int, metrics: dict[str, float]) -> list[tuple[int, str, str]]:
    """(rank, label, value) of each figure the console line may show, in its order."""
    fields = [(0, "step", str(step))]
    for key, rank in _LINE_KEYS:
        # a non-finite step is news; none is not
        if key in metrics and (key != "nonfinite_steps" or metrics[key]):
            fields.append((rank, key, _fmt_value(metrics[key])))
    fields += [(8, key, _fmt_value(metrics[key])) for key in sorted(metrics) if key.startswith("reward/")]
    seconds = sum(v for k, v in metrics.items() if k.startswith("time/") and k not in _DERIVED_TIMES)
    if seconds:
        fields.append((3, "time", _fmt_seconds(seconds)))
    # the GPU's peak over the step's phases; on CPU the process's resident set
    peaks = [v for k, v in metrics.items() if k.startswith("mem/peak_")]
    if peaks or "mem/rss_peak" in metrics:
        fields.append((3, "peak" if peaks else "rss", _fmt_bytes(max(peaks) if peaks else metrics["mem/rss_peak"])))
    return fields


def format_line(step: int, metrics: dict[str, float], width: int = 80) -> str:
    """The step's console line (rich markup), at most `width` columns: `step 12  reward_mean 0.5 ... time 1.20s
    peak 3.10 GiB`. The headline figures only, the least telling dropped first where the terminal is narrow; every
    figure is in metrics.jsonl and the rank's log."""
    fields = _line_fields(step, metrics)

    def plain(kept) -> int:
        return len("  ".join(f"{label} {value}" for _, label, value in kept))

    while len(fields) > 1 and plain(fields) > width:
        fields.remove(max(fields[1:], key=lambda field: field[0]))
    return "  ".join(f"[bold]{label} {value}[/]" if label == "step" else f"[dim]{escape(label)}[/] {escape(value)}"
                     for _, label, value in fields)


class MetricsLogger:
    """Logs `{"step": step, **metrics}` per step to the chosen backends ("console", "jsonl", "wandb").

    `config` (a plain dict) is the run configuration handed to wandb.init. `console`: the rich console the line is
    printed on, the live progress display's (progress.py), so that the line goes above it and not onto it; its width
    is the line's. Usable as a context manager."""

    def __init__(self, run_dir: Path, *, backends: Sequence[str] = ("console", "jsonl"), rank: int = 0,
                 wandb_cfg: WandbConfig | None = None, resume_step: int | None = None, config: dict | None = None,
                 console: Console | None = None):
        if isinstance(backends, str):
            backends = (backends,)
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown metrics backend(s) {unknown}; valid: {list(BACKENDS)}")
        if resume_step is not None and resume_step < 0:
            raise ValueError(f"resume_step must be >= 0, got {resume_step}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.active = rank == 0
        self.backends = tuple(backends)
        self.last_step: int | None = None
        self._file = None
        self._samples_file = None
        self._console = None
        self._wandb = self._wandb_run = None
        self._tensorboard = None
        if not self.active:
            return

        # before touching any file: a missing package should fail the run at once, not at the first log
        if "wandb" in self.backends:
            wandb = self._wandb = _import_wandb()
        if "tensorboard" in self.backends:
            summary_writer = _import_tensorboard()
        if "jsonl" in self.backends:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            kept = _truncate(self.path, resume_step)
            if kept:
                self.last_step = kept[-1]["step"]
            if (self.run_dir / SAMPLES_FILE).exists():
                _truncate(self.run_dir / SAMPLES_FILE, resume_step)
            self._file = open(self.path, "a")
        if "console" in self.backends:
            self._console = console or Console(highlight=False)
        if "wandb" in self.backends:
            cfg = wandb_cfg or WandbConfig()
            self._wandb_run = wandb.init(project=cfg.project, name=cfg.name, mode=cfg.mode,
                                         dir=cfg.dir or str(self.run_dir), config=dict(config or {}),
                                         id=self._wandb_id(resume_step), resume="allow")
        if "tensorboard" in self.backends:
            self._tensorboard = summary_writer(log_dir=str(self.run_dir / TENSORBOARD_DIR),
                                               purge_step=resume_step or 0)

    def _wandb_id(self, resume_step: int | None) -> str:
        """The run's W&B id: the saved one when resuming, else a new one, saved."""
        path = self.run_dir / WANDB_ID_FILE
        if resume_step is not None and path.is_file():
            return path.read_text().strip()
        run_id = secrets.token_hex(4)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id + "\n")
        return run_id

    def destinations(self, samples: int = 0) -> list[str]:
        """Where this logger writes, one line each for the user (rank 0; none elsewhere); `samples`: the responses a
        step logs (log_samples)."""
        if not self.active:
            return []
        lines = []
        if self._file is not None:
            lines.append(f"metrics: every figure of each step in {self.path.resolve()}" + (
                f"; up to {samples} response{'s' * (samples != 1)} a step in {(self.run_dir / SAMPLES_FILE).resolve()}"
                if samples else ""))
        if self._tensorboard is not None:
            where = (self.run_dir / TENSORBOARD_DIR).resolve()
            lines.append(f"tensorboard: event files in {where} (tensorboard --logdir {where})")
        if self._wandb_run is not None:
            lines.append(f"wandb: run {getattr(self._wandb_run, 'id', '?')} in "
                         f"{getattr(self._wandb_run, 'dir', self.run_dir)}")
        return lines

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        if "step" in metrics:
            raise ValueError("'step' is the row's own key; pass it as the step argument, not in metrics")
        if self.last_step is not None and step < self.last_step:
            raise ValueError(f"steps must not decrease: got step {step} after step {self.last_step}")
        self.last_step = step
        values = {k: _to_number(k, v) for k, v in metrics.items()}
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **values}) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._console is not None:
            line = format_line(step, values, width=self._console.width)
            self._console.print(line, soft_wrap=True, highlight=False)
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()

    def log_samples(self, step: int, samples: Sequence[dict]) -> None:
        """A step's samples (samples.py): rows of samples.jsonl, a W&B table, TensorBoard text."""
        if not self.active or not samples:
            return
        rows = [{"step": step, **sample} for sample in samples]
        if "jsonl" in self.backends:
            if self._samples_file is None:
                self._samples_file = open(self.run_dir / SAMPLES_FILE, "a")
            self._samples_file.writelines(json.dumps(row) + "\n" for row in rows)
            self._samples_file.flush()
        if self._wandb_run is not None:
            # a reward's extra figures as columns of their own (None in a row whose reward did not give one)
            columns = [*SAMPLE_COLUMNS, *sample_extra_columns(rows)]
            table = self._wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
            self._wandb_run.log({"samples": table}, step=step)
        if self._tensorboard is not None:
            self._tensorboard.add_text("samples", samples_markdown(step, samples), step)
            self._tensorboard.flush()

    def close(self) -> None:
        for f in (self._file, self._samples_file):
            if f is not None:
                f.close()
        self._file = self._samples_file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _truncate(path: Path, resume_step: int | None) -> list[dict]:
    """Keeps the rows of a jsonl file with step < resume_step (none for a fresh run), rewritten atomically;
    -> the rows kept."""
    for stale in path.parent.glob(f"{path.name}.tmp-*"):
        stale.unlink()
    kept = []
    if resume_step is not None and path.exists():
        kept = [row for row in read_metrics(path) if row["step"] < resume_step]
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return kept


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "the 'wandb' metrics backend needs the wandb package: pip install longstraw[wandb]"
        ) from e
    return wandb


def _import_tensorboard():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(
            "the 'tensorboard' metrics backend needs the tensorboard package: pip install longstraw[tensorboard]"
        ) from e
    return SummaryWriter
