"""Preemption: SIGTERM and SIGUSR1 stop the run after the current step, with a checkpoint and one line.

Slurm sends SIGTERM at the time limit and on preemption, and the signal `--signal` asks for ahead of them
(scripts/slurm/train.sbatch asks for SIGUSR1); torchrun passes SIGTERM (and SIGUSR1, when it is among its
`--signals-to-handle`) on to its workers. The handler only records the signal; the step under way finishes. Once
per step the trainer asks `agreed()`: the ranks agree with one all-reduce of one integer, since a signal reaches
them at different moments and they must all save the same step and stop together. The trainer then writes the
checkpoint and raises `Preempted`: exit status 75 (EX_TEMPFAIL, errors.py); `resume=true` continues without loss.

Simplification: the current step is finished, never abandoned; ask for the signal at least one step plus one
checkpoint ahead of the time limit (the sbatch script asks 10 minutes).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from longstraw_cli.errors import RunError

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(RunError):
    """The run stopped on a signal after writing its checkpoint."""

    exit_code = 75
    kind = "preempted"


class Preemption:
    """Within `with Preemption() as p:` SIGTERM and SIGUSR1 set `p.signum` instead of ending the process (main
    thread only: Python delivers signals there); the previous handlers come back on exit."""

    def __init__(self):
        self.signum = 0
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
        self.signum = self.signum or signum

    def agreed(self, device: torch.device) -> str | None:
        """The signal's name if any rank has received one, on every rank; a collective over all ranks."""
        signum = self.signum
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([signum], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        return signal.Signals(signum).name if signum else None
