"""One writer per run_dir: an advisory lock on run_dir/.lock, held by the `longstraw train` that writes there.

`RunLock(run_dir)` takes `flock(LOCK_EX | LOCK_NB)` on run_dir/.lock and writes its holder into the file (pid,
host, torchrun run id, start time); a second trainer gets `RunLockError` naming the holder's pid. The kernel ends
the lock with the holder's process however it ends (kill -9 included), so a leftover file never blocks a run.
`holder(run_dir)` asks without taking it: the CLI asks before Hydra writes `.hydra/` or a log file into the
run_dir, so a refused launch leaves nothing there.

Under torchrun rank 0 holds the lock; the other ranks only ask, and a lock held by their own launch (the same
torchrun run id) is not in their way.

Simplification: flock is advisory; across nodes it holds only where the filesystem supports it (NFS emulates it
with POSIX locks; Lustre needs the `flock` mount option).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from datetime import datetime
from pathlib import Path

from longstraw_cli.safety.errors import RunError

LOCK_FILE = ".lock"
# a rank that only asks holds a shared lock for an instant: the holder tries again for this long
_ACQUIRE_S = 2.0


class RunLockError(RunError):
    """Another trainer holds the run_dir."""


def _launch() -> str | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else None


def _describe(run_dir: Path, info: dict) -> str:
    where = f"pid {info.get('pid', '?')} on {info.get('host', '?')}, since {info.get('since', '?')}"
    return (f"run_dir {run_dir} is in use by another longstraw train ({where}); wait for it to end, stop it, "
            f"or choose another run_dir")


def _read(f) -> dict:
    f.seek(0)
    try:
        return json.loads(f.read() or "{}")
    except ValueError:
        return {}


def holder(run_dir: str | Path, launch: str | None = None) -> dict | None:
    """Who holds run_dir's lock, or None if it is free; {} if the holder has not written its name within
    _ACQUIRE_S of being asked. With `launch` (this torchrun launch's id), a name of another launch is read again
    for up to _ACQUIRE_S: this launch's rank 0 may have taken the lock over a stale name it has yet to replace."""
    path = Path(run_dir) / LOCK_FILE
    try:
        f = open(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            # the holder writes its name just after it takes the lock: a rank of its own launch that asks in
            # between reads nothing (or the last launch's name), and would refuse to start
            deadline = time.monotonic() + _ACQUIRE_S
            info = _read(f)
            while (not info or (launch is not None and info.get("launch") != launch)) \
                    and time.monotonic() < deadline:
                time.sleep(0.02)
                info = _read(f)
            return info
        fcntl.flock(f, fcntl.LOCK_UN)
        return None


def check(run_dir: str | Path) -> str | None:
    """One line if another launch holds run_dir, else None (a lock held by this torchrun launch is its own)."""
    launch = _launch()
    info = holder(run_dir, launch)
    if info is None or (launch is not None and info.get("launch") == launch):
        return None
    return _describe(Path(run_dir), info)


class RunLock:
    """`with RunLock(run_dir):` holds run_dir's lock, or raises RunLockError naming the holder."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._file = None

    def __enter__(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        f = open(self.run_dir / LOCK_FILE, "a+")
        deadline = time.monotonic() + _ACQUIRE_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    info = _read(f)
                    f.close()
                    raise RunLockError(_describe(self.run_dir, info)) from None
                time.sleep(0.05)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "launch": _launch(),
                            "since": datetime.now().isoformat(timespec="seconds")}))
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
