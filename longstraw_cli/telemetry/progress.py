"""Rank 0's console while a step runs, and one-line notices to the user.

`StepProgress` is a live line under the per-step metrics lines: the step (n of N, with a bar), the prompt of the
step (with prompts_per_step > 1), the phase running now (the iteration's `PhaseClock` tells it each phase as it
starts: capture, rollout, reward, score, replay, finalize, step, val) and its time so far (the rollout: its
response tokens decoded so far), and the ETA over the remaining steps (rich's estimate from the steps' recent
speed). It is live only on a terminal, unless logger.progress forces it: in a log file or a pipe a redrawn line is
noise, so there a phase that runs longer than logger.heartbeat_s says so in one line every heartbeat_s instead (a
27B step at a long response runs for many minutes: a slurm log should not be silent that long). `notice` prints a
line for the user on rank 0 (stderr) and puts it in the log.
"""

from __future__ import annotations

import logging
import sys
import threading
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
    """`enabled` None: live when the console is a terminal. heartbeat_s (rank 0, when not live; 0: never): a line
    for each heartbeat_s that one phase has been running."""

    def __init__(self, total_steps: int, start_step: int, *, enabled: bool | None, rank: int,
                 console: Console | None = None, heartbeat_s: float = 0.0):
        # the metrics logger prints its step lines on this console too: rich puts them above the live line
        self.console = console = console or Console(highlight=False)
        self.live = rank == 0 and (console.is_terminal if enabled is None else enabled)
        self._phase, self._prompt, self._since = "", "", time.perf_counter()
        self._step, self._count = start_step, None
        self._stop, self._beats = None, None
        if not self.live:
            if rank == 0 and heartbeat_s > 0:
                self._heartbeat(heartbeat_s)
            return
        self.bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=24),
                            _PhaseColumn(self), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                            transient=True, refresh_per_second=4)
        self.task = self.bar.add_task("train", total=total_steps, completed=start_step)
        self.bar.start()

    def _tokens(self) -> str:
        """The rollout's response tokens decoded so far, the time a token took and what the rest would take at that
        rate ('' outside a rollout)."""
        if self._count is None:
            return ""
        done, total = self._count
        per_token = (time.perf_counter() - self._since) / max(done, 1)
        # at most: every response may stop before max_new_tokens
        return (f"{done:,} of {total:,} response tokens ({per_token * 1e3:.1f} ms a token so far, at most "
                f"~{per_token * (total - done):.0f} s left)")

    def describe(self) -> str:
        if not self._phase:
            return ""
        tokens = "" if self._count is None else f" {self._count[0]:,}/{self._count[1]:,} tokens"
        return f"{self._prompt}[cyan]{self._phase}[/] {time.perf_counter() - self._since:.0f}s{tokens}"

    def _heartbeat(self, every_s: float) -> None:
        """A daemon thread: a line each every_s that the current phase has been running (none between phases)."""
        self._stop, self._beats = threading.Event(), 0

        def beat():
            while not self._stop.wait(min(every_s, 1.0)):
                phase, since, beats = self._phase, self._since, self._beats
                running = time.perf_counter() - since
                if phase and running >= (beats + 1) * every_s:
                    self._beats = int(running // every_s)
                    tokens = self._tokens()
                    notice(f"step {self._step}: {self._prompt}{phase} running for {running:.0f} s"
                           + (f", {tokens}" if tokens else ""))

        threading.Thread(target=beat, name="longstraw-heartbeat", daemon=True).start()

    def prompt(self, index: int, count: int) -> None:
        if count > 1:
            self._prompt = f"prompt {index + 1}/{count} "

    def phase(self, name: str) -> None:
        self._phase, self._since, self._count, self._beats = name, time.perf_counter(), None, 0
        if self.live:
            self.bar.refresh()

    def count(self, done: int, total: int) -> None:
        """The rollout's progress: `done` of `total` response tokens decoded (a host int, no device sync)."""
        self._count = (done, total)

    def step_done(self) -> None:
        self._phase, self._prompt, self._count = "", "", None
        self._step += 1
        if self.live:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self.live:
            self.bar.stop()
            self.live = False
