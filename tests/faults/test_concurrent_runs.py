"""Two writers: one `longstraw train` per run_dir (an advisory lock; the second gets one line naming the holder's
pid and touches nothing there), the lock ends with its holder however it ends, and default run ids differ even for
two launches in the same second."""

import os
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest

from conftest import rows
from longstraw_cli import cli

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


def test_default_run_ids_differ_within_one_second(monkeypatch):
    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "datetime", Frozen)
    first, second = cli._run_id(), cli._run_id()
    assert first.startswith("20260102-030405") and second.startswith("20260102-030405")
    assert first != second
