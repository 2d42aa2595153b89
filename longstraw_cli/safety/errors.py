"""How a run ends when it does not finish: one line on stderr and an exit status a script can act on.

| status | meaning |
| --- | --- |
| 0 | finished |
| 1 | an unexpected error (a traceback) |
| 2 | bad input, refused at start or at the first use (one line naming the value and the valid choices) |
| 3 | stopped by the non-finite guard (guard.py) |
| 4 | a collective did not complete within dist_timeout_s (watchdog.py) |
| 75 | preempted (SIGTERM, SIGUSR1, a first SIGINT): a checkpoint was written; `resume=true` continues (preemption.py) |
| 130 | interrupted: a second SIGINT, or one before training began; no checkpoint (one line, no traceback) |

75 is sysexits' EX_TEMPFAIL: try again later. Under torchrun each worker exits with its status and torchrun
reports its own (non-zero when a worker's is). Where a launcher set LONGSTRAW_OUTCOME_DIR (scripts/slurm/train.sbatch)
each rank also writes how it ended there, and a preempted one exits 0 (preemption.recorded_outcome).
"""

from __future__ import annotations

import re


class RunError(RuntimeError):
    """Ends a run with its message as one line, `longstraw: <kind>: <message>` (no traceback unless
    HYDRA_FULL_ERROR=1), and `exit_code`."""

    exit_code = 2
    kind = "error"


def first_line(error: BaseException) -> str:
    """An error's first line, without the source-file prefix torch's C++ errors carry ("[alloc_cpu.cpp:127] ...")."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0])
