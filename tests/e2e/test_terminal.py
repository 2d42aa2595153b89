"""What a user sees at a terminal: `longstraw train` under a pseudo-terminal of a given width, its live progress
line and its step lines."""

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import pytest
from rich.text import Text

COLUMNS = 100


def run_in_terminal(args: list[str], cwd, columns: int = COLUMNS, timeout_s: float = 300,
                    env: dict | None = None) -> tuple[int, str]:
    """`longstraw train ARGS` with a pseudo-terminal of `columns` columns as its stdin, stdout and stderr -> (exit
    status, everything it wrote, escape sequences included)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm-256color", **(env or {})}
    env.pop("COLUMNS", None)
    proc = subprocess.Popen([sys.executable, "-m", "longstraw_cli", "train", *args], cwd=cwd, env=env, stdin=child,
                            stdout=child, stderr=child, close_fds=True)
    os.close(child)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([main], [], [], timeout_s)
            assert ready, f"no output in {timeout_s} s: {out[-2000:]!r}"
            try:
                data = os.read(main, 65536)
            except OSError:
                # the child side closed: Linux answers EIO
                break
            if not data:
                break
            out += data
        return proc.wait(timeout=timeout_s), out.decode(errors="replace")
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_step_lines_fit_the_terminal_each_on_a_line_of_its_own(tmp_path):
    code, out = run_in_terminal(["prompt_tokens=64", "response_tokens=4", "group_size=2", "steps=3",
                                 f"run_dir={tmp_path / 'run'}"], tmp_path)
    assert code == 0, out[-3000:]
    # what stays on the screen: the text between carriage returns and newlines, escape sequences dropped
    pieces = [Text.from_ansi(p).plain for p in re.split(r"[\r\n]", out)]
    steps = [p for p in pieces if "reward_mean" in p]
    assert [p.split()[:2] for p in steps] == [["step", "0"], ["step", "1"], ["step", "2"]], steps
    assert all(len(p) <= COLUMNS for p in steps), steps
    # the live line was there, and cleared before each step line
    assert any("ETA" in p for p in pieces) and not any("ETA" in p for p in steps), steps


@pytest.mark.slow
def test_a_logger_that_fails_to_start_leaves_no_live_line_behind(tmp_path):
    """logger=wandb where wandb does not import: one line and exit 2, and no live line was started before it (whose
    hidden cursor rich would leave hidden, and whose redraw would follow the error)."""
    blocked = tmp_path / "blocked"
    (blocked / "wandb").mkdir(parents=True)
    (blocked / "wandb" / "__init__.py").write_text("raise ImportError('wandb is blocked by this test')\n")
    path = os.pathsep.join(filter(None, [str(blocked), os.environ.get("PYTHONPATH")]))
    code, out = run_in_terminal(["logger=wandb", "steps=1", f"run_dir={tmp_path / 'run'}"], tmp_path,
                                env={"PYTHONPATH": path})
    assert code == 2 and "wandb" in out, out[-3000:]
    assert "\x1b[?25l" not in out and "ETA" not in out, out[-3000:]
