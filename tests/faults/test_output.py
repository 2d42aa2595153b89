"""A console whose reader went away (safety/output.py): writes, writelines and flushes never raise, and once one
failed the descriptor writes to /dev/null."""

import io
import os

from longstraw_cli.safety.output import _Guarded


class Closed(io.StringIO):
    """A stream whose reader is gone: every write and flush is EPIPE."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd, self.writes = fd, 0

    def write(self, text):
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        return self.fd


def test_a_gone_reader_is_buried_once_and_nothing_raises(tmp_path):
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        stream = Closed(fd)
        guarded = _Guarded(stream)
        assert guarded.write("step 1\n") == len("step 1\n")
        guarded.writelines(["a\n", "b\n"])
        guarded.flush()
        # the first failure buried the stream: nothing more reaches it, and its descriptor is /dev/null now
        assert stream.writes == 1
        os.write(fd, b"after")
        assert path.read_bytes() == b""
    finally:
        os.close(fd)
