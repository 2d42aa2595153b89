"""Console output that cannot stop a run: a stdout or stderr whose reader went away.

`longstraw train ... 2>&1 | tee run.log`, then Ctrl-C: the terminal sends SIGINT to the whole pipeline, tee dies,
and the trainer's next write to the pipe fails with EPIPE (Python ignores SIGPIPE: a BrokenPipeError). A terminal
that was closed gives EIO, `longstraw plan | head -4` a pipe closed after four lines. None of these may stop the
program: what the trainer prints is in the run dir's log too (train_rank<R>.log), and a first SIGINT still ends
with a checkpoint and exit 75.

`guard_console()` puts a `_Guarded` stream in place of sys.stdout and sys.stderr. The first write or flush that
fails points the stream's file descriptor at /dev/null, so that later writes (the signal handler's os.write, C++
warnings, the interpreter's last flush) succeed there, and the text is dropped.
"""

from __future__ import annotations

import contextlib
import os
import sys


class _Guarded:
    """A text stream whose write and flush never raise OSError; everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream
        self._dead = False

    def write(self, text: str) -> int:
        if not self._dead:
            try:
                return self._stream.write(text)
            except OSError:
                self._bury()
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._dead:
            return
        try:
            self._stream.flush()
        except OSError:
            self._bury()

    def _bury(self) -> None:
        """The reader is gone: its descriptor onto /dev/null, where the text still buffered is flushed."""
        self._dead = True
        with contextlib.suppress(OSError, ValueError):
            _to_devnull(self._stream.fileno())
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _to_devnull(fd: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    if devnull != fd:
        os.dup2(devnull, fd)
        os.close(devnull)


def guard_console() -> None:
    """sys.stdout and sys.stderr as `_Guarded` streams (once; a second call changes nothing)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        # None: the descriptor was closed at start (`>&-`), and print writes nothing
        if stream is not None and not isinstance(stream, _Guarded):
            setattr(sys, name, _Guarded(stream))
