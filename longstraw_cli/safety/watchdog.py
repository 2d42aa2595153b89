"""Collective timeouts: a rank that stops answering (stopped, hung, dead) makes the others stop within
`dist_timeout_s`, each with one line naming the collective it waited in, instead of waiting for ever.

Every process group (the default one and ParallelDims' cp / dp / ep groups) is made with timeout=dist_timeout_s.
On gloo a collective that has not completed by then raises on the waiting rank; `explain` turns that error into
`CollectiveTimeout` (exit status 4): the step and phase the rank was in, and the collective from torch's flight
recorder (the newest one the rank issued: its op, sequence number and process group), which this module switches
on (TORCH_FR_BUFFER_SIZE) unless the environment sets it. The CLI then ends the process at once (`os._exit`):
tearing down a process group whose peer is gone can block.

Not verified here (no GPU): on NCCL, torch's own watchdog aborts a rank whose collective passed the same timeout,
with its own message naming the op (`WorkNCCL(SeqNum=..., OpType=...)`), before this module sees an error.
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta

import torch.distributed as dist

from longstraw_cli.safety.errors import RunError, first_line

# gloo's and the TCP store's words for a peer that does not answer or has gone
_FAILED_PEER = re.compile(r"timed out|timeout|connection closed by peer|connection reset by peer|broken pipe", re.I)
FLIGHT_RECORDER_ENTRIES = "64"


class CollectiveTimeout(RunError):
    """A collective did not complete: another rank stopped answering or died."""

    exit_code = 4
    # the process group cannot be torn down cleanly: the CLI exits the process directly
    hard_exit = True


def init_process_group(backend: str, timeout_s: float) -> None:
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def newest_collective() -> str | None:
    """'<op> #<seq> on process group <name>' of the newest collective the flight recorder holds, or None."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        entries = json.loads(_dump_fr_trace_json()).get("entries", [])
    except Exception:  # noqa: BLE001 - a private torch API: without it the line names the phase only
        return None
    if not entries:
        return None
    entry = entries[-1]
    op = str(entry.get("profiling_name", "?")).partition(":")[2] or entry.get("profiling_name", "?")
    group = entry.get("process_group", ["?"])
    name = group[1] if len(group) > 1 and group[1] else group[0]
    return f"{op} #{entry.get('collective_seq_id', '?')} on process group {name}"


def explain(error: BaseException, *, rank: int, where: str, timeout_s: float) -> CollectiveTimeout | None:
    """CollectiveTimeout for an error of a collective whose peer did not answer, else None (not ours to explain)."""
    if not dist.is_initialized() or not isinstance(error, RuntimeError) or not _FAILED_PEER.search(str(error)):
        return None
    collective = newest_collective() or "a collective"
    return CollectiveTimeout(
        f"rank {rank}: {collective} did not complete ({where}, dist_timeout_s={timeout_s:g}): {first_line(error)}; "
        f"another rank stopped answering or died, see its train_rank*.log")
