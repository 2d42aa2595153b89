"""Silence and hangs: under torchrun, a rank that stops answering (SIGSTOP) makes the other one exit within
dist_timeout_s with one line naming the collective it waited in, instead of waiting for ever."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TIMEOUT_S = 4


def worker_of_rank(parent: int, rank: int) -> int | None:
    """The pid of `parent`'s child process that torchrun started as `rank`, if it is running."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def running(pid: int) -> bool:
    """Whether `pid` runs (an exited child that its parent has not reaped yet is a zombie: not running)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_rank_makes_the_other_exit_with_one_line_naming_the_collective(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "longstraw_cli",
         "train", "prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]", "steps=100000",
         "checkpoint.every=0", f"dist_timeout_s={TIMEOUT_S}", f"run_dir={run}"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 1):
            assert torchrun.poll() is None, torchrun.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run logged no step in time"
            time.sleep(0.05)
        waiting, stopped = worker_of_rank(torchrun.pid, 0), worker_of_rank(torchrun.pid, 1)
        assert waiting is not None and stopped is not None
        os.kill(stopped, signal.SIGSTOP)
        since = time.monotonic()
        while running(waiting) and time.monotonic() < since + 120:
            time.sleep(0.05)
        waited = time.monotonic() - since
    finally:
        if stopped is not None:
            # torchrun would end it after its own grace; this test's grandchild is ended here, sooner
            os.kill(stopped, signal.SIGKILL)
        try:
            _, err = torchrun.communicate(timeout=120)
        finally:
            if torchrun.poll() is None:
                torchrun.kill()
                torchrun.wait()
    assert torchrun.returncode != 0
    lines = [line for line in err.splitlines() if "longstraw: error: rank 0:" in line]
    assert len(lines) == 1, err[-3000:]
    assert "did not complete" in lines[0] and f"dist_timeout_s={TIMEOUT_S}" in lines[0], lines[0]
    assert "on process group " in lines[0] and "another rank stopped answering or died" in lines[0], lines[0]
    assert "rank 0:" in (run / "train_rank0.log").read_text().splitlines()[-1]
    print(f"rank 0 stopped {waited:.1f} s after rank 1 was: {lines[0]}")
    # the timeout and the rest of a step of the tiny run, with slack for a loaded machine
    assert waited < TIMEOUT_S + 30
