"""Rank 0's console while a step runs, and one-line notices to the user.

`StepProgress` is a live line under the per-step metrics lines: the step (n of N, with a bar), the prompt of the
step (with prompts_per_step > 1), the phase running now (the iteration's `PhaseClock` tells it each phase as it
starts: capture, rollout, reward, score, replay, finalize, step, val) and its time so far, and the ETA over the
remaining steps (rich's estimate from the steps' recent speed). It is live only on a terminal, unless
logger.progress forces it: in a log file or a pipe a redrawn line is noise. `notice` prints a line for the user
on rank 0 (stderr) and puts it in the log.
"""

from __future__ import annotations

import logging
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

log = logging.getLogger("longstraw")


def notice(message: str, rank: int = 0) -> None:
    """One line for the user, on rank 0 only; every rank logs it."""
    log.info(message)
    if rank == 0:
        print(f"longstraw: {message}", file=sys.stderr, flush=True)


class _PhaseColumn(ProgressColumn):
    """The prompt and phase running now, with its time so far (computed at each redraw)."""

    def __init__(self, owner: StepProgress):
        super().__init__()
        self.owner = owner

    def render(self, task) -> Text:
        return Text.from_markup(self.owner.describe())


class StepProgress:
    """`enabled` None: live when the console is a terminal. Every method is a no-op when not live."""

    def __init__(self, total_steps: int, start_step: int, *, enabled: bool | None, rank: int,
                 console: Console | None = None):
        console = console or Console()
        self.live = rank == 0 and (console.is_terminal if enabled is None else enabled)
        self._phase, self._prompt, self._since = "", "", time.perf_counter()
        if not self.live:
            return
        self.bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=24),
                            _PhaseColumn(self), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                            transient=True, refresh_per_second=4)
        self.task = self.bar.add_task("train", total=total_steps, completed=start_step)
        self.bar.start()

    def describe(self) -> str:
        if not self._phase:
            return ""
        return f"{self._prompt}[cyan]{self._phase}[/] {time.perf_counter() - self._since:.0f}s"

    def prompt(self, index: int, count: int) -> None:
        if self.live and count > 1:
            self._prompt = f"prompt {index + 1}/{count} "

    def phase(self, name: str) -> None:
        if self.live:
            self._phase, self._since = name, time.perf_counter()
            self.bar.refresh()

    def step_done(self) -> None:
        if self.live:
            self._phase, self._prompt = "", ""
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.live:
            self.bar.stop()
            self.live = False
