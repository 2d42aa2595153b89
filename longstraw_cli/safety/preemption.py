"""Preemption: SIGTERM, SIGUSR1 and a first SIGINT stop the run after the current step, with a checkpoint and one
line; a second SIGINT (Ctrl-C twice) ends the process at once, without a checkpoint, in one line.

Slurm sends SIGTERM at the time limit and on preemption; scripts/slurm/train.sbatch sends SIGUSR1 ahead of the
time limit. torchrun passes SIGTERM and SIGINT (and SIGUSR1, when it is among its `--signals-to-handle`) on to its
workers. The handler only records the signal; the step under way finishes. Once per step the trainer asks
`agreed()`: the ranks agree with one all-reduce of one integer, since a signal reaches them at different moments
and they must all save the same step and stop together. The trainer then writes the checkpoint and raises
`Preempted`: exit status 75 (EX_TEMPFAIL, errors.py); `resume=true` continues without loss.

A launcher that sets LONGSTRAW_OUTCOME_DIR reads how each rank's run ended from a file there (`recorded_outcome`):
torchrun reports one status for all its workers and calls 75 a failure, so the exit status cannot tell it.

Simplification: the current step is finished, never abandoned; the signal must come at least one step plus one
checkpoint ahead of the time limit (the sbatch script sends it 10 minutes ahead, less on a short job).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw_cli.safety.errors import RunError

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# where a launcher (scripts/slurm/train.sbatch) asks each rank to write how its run ended
OUTCOME_DIR = "LONGSTRAW_OUTCOME_DIR"
ABORTED = 130  # 128 + SIGINT: what a shell reports for a process that Ctrl-C ended


class Preempted(RunError):
    """The run stopped on a signal after writing its checkpoint."""

    exit_code = 75
    kind = "preempted"


class Preemption:
    """Within `with Preemption() as p:` SIGTERM, SIGUSR1 and SIGINT set `p.signum` instead of ending the process
    (main thread only: Python delivers signals there); a second SIGINT ends it at once. The previous handlers come
    back on exit."""

    def __init__(self):
        self.signum = 0
        self.interrupted = False
        self._previous = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _record(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._interrupt()
        self.signum = self.signum or signum

    def _interrupt(self) -> None:
        if self.interrupted:
            _say(b"longstraw: interrupted: a second SIGINT: stopped at once, without a checkpoint\n")
            write_outcome(f"failed {ABORTED}")
            # no exception: unwinding could block in a collective or in a process group's teardown
            os._exit(ABORTED)
        self.interrupted = True
        if os.environ.get("RANK", "0") == "0":
            _say(b"longstraw: SIGINT: stopping after this step with a checkpoint (SIGINT again: stop at once, "
                 b"without one)\n")

    def agreed(self, device: torch.device) -> str | None:
        """The signal's name if any rank has received one, on every rank; a collective over all ranks."""
        signum = self.signum
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([signum], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        return signal.Signals(signum).name if signum else None


def _say(line: bytes) -> None:
    """A line on stderr from the signal handler: os.write, not print, since the handler may run while the main thread
    is inside a print to stderr. On a terminal the progress line is cleared first; where the reader is gone (a Ctrl-C
    that also ended `| tee`) the line is dropped: the run must go on to its checkpoint."""
    with contextlib.suppress(OSError):
        os.write(2, (b"\r\x1b[2K" if os.isatty(2) else b"") + line)


def write_outcome(outcome: str) -> None:
    """`outcome` into LONGSTRAW_OUTCOME_DIR/rank<RANK> when a launcher set it: written whole, then renamed, so a
    reader never sees half of it."""
    directory = os.environ.get(OUTCOME_DIR)
    if not directory:
        return
    path = Path(directory) / f"rank{os.environ.get('RANK', '0')}"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(outcome + "\n")
    partial.replace(path)


@contextlib.contextmanager
def recorded_outcome():
    """How the run within ends, for a launcher that set LONGSTRAW_OUTCOME_DIR: `finished`, `preempted` (a
    checkpoint was written) or `failed <exit status>`. A rank that leaves no file was killed, or ended before it
    could write one (a collective timeout ends the process at once): a failure too. Under such a launcher a
    preempted run exits 0, not 75: torchrun would report 75 as a failed worker (a traceback and a FAILED banner)
    and slurm the step as FAILED, and the launcher reads the outcome from the file."""
    if not os.environ.get(OUTCOME_DIR):
        yield
        return
    try:
        yield
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code == Preempted.exit_code:
            write_outcome("preempted")
            raise SystemExit(0) from None
        write_outcome("finished" if code == 0 else f"failed {code}")
        raise
    except BaseException:
        write_outcome("failed 1")
        raise
    write_outcome("finished")
