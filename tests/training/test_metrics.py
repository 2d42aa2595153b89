"""metrics.jsonl (rows, resume truncation, rank gating), the console line, the wandb backend's import error and
calls, WandbConfig validation and the memory plot."""

import json
import sys
import types

import pytest

from longstraw_cli.telemetry.metrics import MetricsLogger, WandbConfig, format_line, read_metrics
from longstraw_cli.telemetry.plot import plot_memory


def row(step):
    """Deterministic metrics of a step, as a seeded run would produce them."""
    return {"reward_mean": 0.25 * (step % 4), "loss": -0.01 * step, "clip_frac": 0.125, "grad_norm": 1.5 + step,
            "num_tokens": 100 + step, "time/capture": 0.5, "time/replay": 1.25 + step,
            "mem/resident": 3 * 2**30, "mem/peak_replay": (4 + 0.5 * step) * 2**30}


def run(run_dir, steps, resume_step=None):
    logger = MetricsLogger(run_dir, backends=("jsonl",), resume_step=resume_step)
    for s in steps:
        logger.log(s, row(s))
    return logger


def test_rows_are_written_and_read_back(tmp_path):
    run(tmp_path, range(3)).close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [{"step": s, **row(s)} for s in range(3)]
    assert list(rows[0])[0] == "step"


def test_resume_truncates_to_an_uninterrupted_run(tmp_path):
    run(tmp_path / "straight", range(8)).close()

    killed = tmp_path / "killed"
    # killed after step 5 with a checkpoint at step 3 (resume at 4), halfway through writing step 6's row
    run(killed, range(6))
    with open(killed / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 0.')
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == list(range(6))

    logger = MetricsLogger(killed, backends=("jsonl",), resume_step=4)
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="decrease"):
        logger.log(2, row(2))
    for s in range(4, 8):
        logger.log(s, row(s))
    logger.close()
    assert (killed / "metrics.jsonl").read_bytes() == (tmp_path / "straight" / "metrics.jsonl").read_bytes()


def test_fresh_run_replaces_the_file_and_other_ranks_write_nothing(tmp_path):
    run(tmp_path, range(5)).close()
    run(tmp_path, range(2)).close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]

    other = MetricsLogger(tmp_path / "rank1", backends=("console", "jsonl"), rank=1)
    other.log(0, row(0))
    other.close()
    assert not (tmp_path / "rank1").exists()


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="console"):
        MetricsLogger(tmp_path, backends=("mlflow",))
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        with pytest.raises(ValueError, match="step"):
            logger.log(0, {"step": 1.0})
        with pytest.raises(ValueError, match="'loss'"):
            logger.log(0, {"loss": "low"})


def test_console_line_is_one_line_in_a_stable_order(tmp_path, capsys):
    shuffled = dict(reversed(list(row(2).items())))
    line = format_line(2, shuffled)
    assert line == format_line(2, row(2))
    with MetricsLogger(tmp_path, backends=("console",)) as logger:
        logger.log(2, shuffled)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and not (tmp_path / "metrics.jsonl").exists()
    order = ["step 2", "reward_mean 0.5", "loss -0.02", "clip_frac 0.125", "grad_norm 3.5", "num_tokens 102",
             "capture 500ms", "replay 3.25s", "resident 3.00 GiB", "peak_replay 5.00 GiB"]
    positions = [out.index(piece) for piece in order]
    assert positions == sorted(positions), out
    assert "300.0 MiB" in format_line(0, {"mem/resident": 300 * 2**20})


def test_console_times_keep_their_figures():
    # a decode step of 4.8 ms and a reward of 0.2 ms once printed as `0.00s`
    line = format_line(0, {"time/decode_step": 0.0048, "time/reward": 2.1e-4, "time/capture": 64.3,
                           "time/step": 0.0})
    assert "decode_step 4.8ms" in line and "reward 210us" in line and "capture 64.30s" in line
    assert "step 0us" in line and "0.00s" not in line


def test_wandb_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install longstraw\[wandb\]"):
        MetricsLogger(tmp_path, backends=("jsonl", "wandb"))
    assert not (tmp_path / "metrics.jsonl").exists(), "nothing is written before the backend check"


def test_wandb_backend_calls(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = WandbConfig(project="p", mode="disabled", name="n")
    with MetricsLogger(tmp_path, backends=("wandb",), wandb_cfg=cfg, config={"lr": 1e-3}) as logger:
        logger.log(7, {"loss": 0.5})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert calls == [
        ("init", dict(project="p", name="n", mode="disabled", dir=str(tmp_path), config={"lr": 1e-3}, id=run_id,
                      resume="allow")),
        ("log", {"loss": 0.5}, 7),
        ("finish",),
    ]
    # a resumed run opens the same W&B run; a fresh one in the same directory draws a new id
    calls.clear()
    MetricsLogger(tmp_path, backends=("wandb",), wandb_cfg=cfg, resume_step=8).close()
    MetricsLogger(tmp_path, backends=("wandb",), wandb_cfg=cfg).close()
    resumed, fresh = (kwargs for name, *kwargs in calls if name == "init")
    assert resumed[0]["id"] == run_id and fresh[0]["id"] != run_id


def test_tensorboard_backend_writes_scalars_and_drops_rows_past_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, backends=("tensorboard",)) as logger:
        for step in range(3):
            logger.log(step, {"loss": float(step), "time/replay": 0.5})
    # killed after step 2, resumed from the checkpoint of step 1: step 2 is logged again
    with MetricsLogger(tmp_path, backends=("tensorboard",), resume_step=2) as logger:
        logger.log(2, {"loss": 20.0, "time/replay": 0.5})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    assert "time/replay" in events.Tags()["scalars"]


def test_tensorboard_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install longstraw\[tensorboard\]"):
        MetricsLogger(tmp_path, backends=("jsonl", "tensorboard"))


def test_wandb_config_rejects_bad_mode():
    with pytest.raises(ValueError, match="'offline', 'online', 'disabled'.*'cloud'"):
        WandbConfig(mode="cloud")


def test_memory_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    run(tmp_path, range(6)).close()
    out = plot_memory(tmp_path / "metrics.jsonl", tmp_path / "memory.png")
    assert out == tmp_path / "memory.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []

    (tmp_path / "no_mem.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no mem/"):
        plot_memory(tmp_path / "no_mem.jsonl", tmp_path / "none.png")
