"""Two writers: one `longstraw train` per run_dir (an advisory lock; the second gets one line naming the holder's
pid and touches nothing there), the lock ends with its holder however it ends, and default run ids differ even for
two launches in the same second."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime

import pytest

from conftest import rows
from longstraw_cli import cli
from longstraw_cli.safety import runlock

SMALL = ["prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]"]


@pytest.mark.slow
def test_a_second_trainer_on_a_run_dir_in_use_is_refused_and_touches_nothing(train_here, one_thread, tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "longstraw_cli", "train", *SMALL, "steps=100000",
                              "checkpoint.every=1", f"run_dir={run}"], cwd=tmp_path, env={**os.environ,
                             "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step_00000001" / "COMPLETE").exists():
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first trainer wrote no checkpoint in time"
            time.sleep(0.05)
        # a checkpoint the first trainer is writing, as a second trainer would find it
        in_progress = run / "checkpoints" / "step_00000099.tmp-12345"
        in_progress.mkdir()
        config, log = (run / ".hydra" / "config.yaml").read_text(), (run / "train_rank0.log").read_text()
        # resume=true first: before the lock it exited 0 after deleting the in-progress checkpoint
        for args in (["resume=true"], []):
            code, _, err = train_here([*SMALL, "steps=1", "optim.lr=0.5", f"run_dir={run}", *args])
            assert code == 2, err
            lines = err.strip().splitlines()
            assert len(lines) == 1 and f"is in use by another longstraw train (pid {first.pid} on " in lines[0], err
        assert in_progress.is_dir()
        assert (run / ".hydra" / "config.yaml").read_text() == config
        assert (run / "train_rank0.log").read_text().startswith(log)
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # the kernel ends the lock with its holder, kill -9 included: the run_dir can be resumed at once
    done = len(rows(run))
    code, _, err = train_here([*SMALL, f"steps={done + 1}", f"run_dir={run}", "resume=true"])
    assert code == 0, err


def test_a_launch_the_lock_refuses_leaves_the_run_dir_it_found_missing(train_here, tmp_path, monkeypatch):
    """Two launches that both found run_dir missing and made it: the one the lock refuses does not remove it (a
    launch refused at set-up removes a run dir it made), since the other trains there."""
    run = tmp_path / "run"
    # both asked before either held the lock, and both made the directory
    monkeypatch.setattr(runlock, "check", lambda run_dir: None)
    monkeypatch.setattr(cli, "_prepare_run_dir", lambda overrides: run.mkdir(exist_ok=True) or True)
    with runlock.RunLock(run):
        code, _, err = train_here([*SMALL, "steps=1", f"run_dir={run}"])
        assert code == 2 and f"is in use by another longstraw train (pid {os.getpid()} on " in err, err
        assert (run / runlock.LOCK_FILE).is_file()


def test_default_run_ids_differ_within_one_second(monkeypatch):
    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "datetime", Frozen)
    first, second = cli._draw_run_id(), cli._draw_run_id()
    assert first.startswith("20260102-030405") and second.startswith("20260102-030405")
    assert first != second


def test_a_rank_that_asks_while_its_launch_writes_the_lock_waits_for_the_name(tmp_path, monkeypatch):
    """Rank 0 takes the lock, then writes its name; a rank of the same launch that asks in between read an empty
    file (or the last launch's name), took it for another launch's lock and refused to start (a CI failure of the
    torchrun resume test)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    with open(tmp_path / runlock.LOCK_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)

        def write(launch):
            time.sleep(0.3)
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"pid": 1234, "host": "h", "launch": launch, "since": "s"}))
            f.flush()

        writer = threading.Thread(target=write, args=("launch-1",))
        writer.start()
        assert runlock.check(tmp_path) is None
        writer.join()
        # a resumed launch's rank 0 takes the lock over the last launch's name, then replaces it
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": 99, "host": "h", "launch": "launch-0", "since": "s"}))
        f.flush()
        writer = threading.Thread(target=write, args=("launch-1",))
        writer.start()
        assert runlock.check(tmp_path) is None
        writer.join()
        # another launch's lock, whose name comes late, is still refused and named
        writer = threading.Thread(target=write, args=("launch-2",))
        f.seek(0)
        f.truncate()
        writer.start()
        assert "in use by another longstraw train (pid 1234 on h" in runlock.check(tmp_path)
        writer.join()
