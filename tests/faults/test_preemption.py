"""Lost work: SIGTERM (slurm's at the time limit and on preemption), SIGUSR1 (what the sbatch script sends ahead
of them) and a first SIGINT (Ctrl-C) finish the current step, write a checkpoint, print one line and exit 75;
`resume=true` then continues as if the run had not stopped. A second SIGINT stops at once, in one line. One process,
and torchrun with two ranks (torchrun passes SIGTERM on to them). Under slurm: tests/e2e/test_slurm.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import rows

E2E = Path(__file__).parent.parent / "e2e"
STEPS = 6
# a reward that varies within every group: each step moves the weights, so a lost or repeated step shows
COMMON = ["prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]", f"steps={STEPS}",
          "checkpoint.every=100", "task.reward=rewards_for_tests:char_sum"]
DETERMINISTIC = ("reward_mean", "loss", "grad_norm", "entropy", "num_tokens")


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    # one intra-op thread: tiny tensors, and two threads per process stall badly on a busy 2-core machine
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(E2E), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def signal_after_first_step(proc: subprocess.Popen, run: Path, signum: int, timeout_s: float = 300) -> tuple:
    """Sends `signum` once the run has logged a step; -> (exit code, stderr). The run must still be going."""
    deadline = time.monotonic() + timeout_s
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None, f"the run ended before the signal: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "the run logged no step in time"
        time.sleep(0.05)
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the run did not stop within {timeout_s} s of {signal.Signals(signum).name}")
    return proc.returncode, err


def deterministic(run: Path) -> list[dict]:
    return [{k: r[k] for k in ("step", *DETERMINISTIC)} for r in rows(run)]


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """The uninterrupted run's `deterministic` rows, once the first test that needs them has trained it: SIGTERM's
    and SIGINT's resumes compare with the same run (the same arguments), so it runs once a module."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
def test_signal_checkpoints_and_resume_continues_without_loss(train_here, one_thread, uninterrupted, tmp_path,
                                                               monkeypatch, signum):
    run = tmp_path / "run"
    # SIGUSR1's run has checkpoint.enabled=false: no periodic or final checkpoint, but a signal still writes one
    off = ["checkpoint.enabled=false"] if signum == signal.SIGUSR1 else []
    proc = start(["-m", "longstraw_cli", "train", *COMMON, *off, f"run_dir={run}"], tmp_path)
    code, err = signal_after_first_step(proc, run, signum)
    name = signal.Signals(signum).name
    assert code == 75, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"longstraw: preempted: {name} received: stopped after step"), err[-3000:]
    done = len(rows(run))
    assert 1 <= done < STEPS
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{done:08d}"]
    assert f"step_{done:08d}" in last and f"{name} received" in (run / "train_rank0.log").read_text()
    if signum == signal.SIGINT:
        # Ctrl-C is answered at once: the step under way finishes first
        assert "longstraw: SIGINT: stopping after this step with a checkpoint (SIGINT again: stop at once" in err
    if signum == signal.SIGUSR1:
        return
    # resumed, the run logs what an uninterrupted one does: no step lost, none repeated
    monkeypatch.syspath_prepend(str(E2E))
    code, _, err = train_here([*COMMON, f"run_dir={run}", "resume=true"])
    assert code == 0, err
    if "rows" not in uninterrupted:
        code, _, err = train_here([*COMMON, f"run_dir={tmp_path / 'whole'}"])
        assert code == 0, err
        uninterrupted["rows"] = deterministic(tmp_path / "whole")
    assert deterministic(run) == uninterrupted["rows"]
    assert [r["step"] for r in rows(run)] == list(range(STEPS))


@pytest.mark.slow
def test_second_sigint_stops_at_once_in_one_line(tmp_path):
    run = tmp_path / "run"
    # longer steps (64 decode steps each): the second SIGINT comes while the first one's step is still under way
    longer = [o for o in COMMON if not o.startswith("response_tokens=")] + ["response_tokens=64"]
    proc = start(["-m", "longstraw_cli", "train", *longer, f"run_dir={run}"], tmp_path)
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    # the second one once the first has been taken (two pending SIGINTs would be delivered as one)
    lines = []
    while not any("SIGINT again" in line for line in lines):
        lines.append(proc.stderr.readline())
        assert lines[-1], f"the run ended without answering the first SIGINT: {''.join(lines)[-2000:]}"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    err = "".join(lines) + err
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "longstraw: interrupted: a second SIGINT: stopped at once, without a " \
                                           "checkpoint", err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_torchrun_checkpoints_every_rank_and_resume_continues(tmp_path):
    """torchrun passes its SIGTERM on to both ranks; they agree on the step to stop after, rank 0 writes the
    checkpoint, and a resumed launch continues from it."""
    run = tmp_path / "run"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "longstraw_cli",
                "train", *COMMON, f"run_dir={run}"]
    code, err = signal_after_first_step(start(torchrun, tmp_path), run, signal.SIGTERM)
    # torchrun ends with its own non-zero status when it was signalled; each worker exited 75
    assert code != 0
    done = len(rows(run))
    assert 1 <= done < STEPS, err[-3000:]
    assert (run / "checkpoints" / f"step_{done:08d}" / "COMPLETE").is_file(), err[-3000:]
    for rank in range(2):
        assert f"SIGTERM received: stopped after step {done - 1}" in (run / f"train_rank{rank}.log").read_text()
    resumed = start([*torchrun, "resume=true"], tmp_path)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"starting at step {done} of {STEPS}" in (run / "train_rank1.log").read_text()
    assert [r["step"] for r in rows(run)] == list(range(STEPS))
    assert (run / "checkpoints" / f"step_{STEPS:08d}" / "COMPLETE").is_file()


@pytest.mark.slow
def test_sigint_under_a_pipe_whose_reader_it_kills_still_checkpoints(tmp_path):
    """`longstraw train ... 2>&1 | tee run.log`, then Ctrl-C: the terminal sends SIGINT to the whole process group,
    the reader dies with it, and every later write of the trainer's goes to a closed pipe. The run still finishes its
    step, writes the checkpoint and exits 75; its log in the run dir has the step lines and the last line."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(E2E), os.environ.get("PYTHONPATH")]))}
    # the logger's console too: the step lines are written to the pipe
    argv = [sys.executable, "-m", "longstraw_cli", "train", *COMMON, "logger.backends=[console,jsonl]",
            f"run_dir={run}"]
    trainer = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               process_group=0)
    # the reader in the trainer's process group, as a shell puts a pipeline's processes in one, with SIGINT at its
    # default as a terminal's shell leaves it (a suite started in a non-interactive shell's background inherits it
    # ignored, and tee would outlive the Ctrl-C)
    pipe = subprocess.Popen(["tee", "run.log"], cwd=tmp_path, stdin=trainer.stdout, stdout=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            process_group=trainer.pid)
    trainer.stdout.close()
    try:
        deadline = time.monotonic() + 300
        metrics = run / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert trainer.poll() is None, (run / "train_rank0.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the run logged no step in time"
            time.sleep(0.05)
        os.killpg(trainer.pid, signal.SIGINT)
        assert pipe.wait(timeout=30) != 0
        code = trainer.wait(timeout=300)
    finally:
        for proc in (trainer, pipe):
            if proc.poll() is None:
                proc.kill()
    log = (run / "train_rank0.log").read_text()
    assert code == 75, log[-3000:]
    done = len(rows(run))
    assert 1 <= done < STEPS
    assert (run / "checkpoints" / f"step_{done:08d}" / "COMPLETE").is_file()
    assert f"SIGINT received: stopped after step {done - 1} with checkpoint step_{done:08d}" in log
    assert all(f"rank 0 step {s} " in log for s in range(done)), log[-3000:]
