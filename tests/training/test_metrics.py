"""metrics.jsonl (rows, resume truncation, rank gating), the console line (its figures, its width, above the live
progress line), the wandb backend's import error and calls, WandbConfig validation, a step's samples and its
rewards' extra figures (samples.py), and the memory plot."""

import io
import json
import re
import sys
import types

import pytest
from rich.console import Console
from rich.text import Text

from longstraw_cli.rl.reward_adapters import Scores
from longstraw_cli.rl.tasks import Example
from longstraw_cli.telemetry.metrics import MetricsLogger, WandbConfig, format_line, read_metrics
from longstraw_cli.telemetry.plot import plot_memory
from longstraw_cli.telemetry.progress import StepProgress
from longstraw_cli.telemetry.samples import PROMPT_TAIL_CHARS, StepRecord, extra_means, merge_sums


def row(step):
    """Deterministic metrics of a step, as a seeded run would produce them."""
    return {"reward_mean": 0.25 * (step % 4), "loss": -0.01 * step, "clip_frac": 0.125, "grad_norm": 1.5 + step,
            "num_tokens": 100 + step, "time/capture": 0.5, "time/replay": 1.25 + step,
            "mem/resident": 3 * 2**30, "mem/peak_replay": (4 + 0.5 * step) * 2**30}


def plain(step, metrics, width=80) -> str:
    """The console line as the terminal shows it."""
    return Text.from_markup(format_line(step, metrics, width=width)).plain


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


def test_console_line_is_one_line_of_headline_figures_in_a_stable_order(tmp_path, capsys):
    shuffled = dict(reversed(list(row(2).items())))
    line = format_line(2, shuffled)
    assert line == format_line(2, row(2))
    with MetricsLogger(tmp_path, backends=("console",)) as logger:
        logger.log(2, shuffled)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and not (tmp_path / "metrics.jsonl").exists()
    # the step's time is its phases' sum; its memory the highest phase peak (on CPU, the process's resident set)
    order = ["step 2", "reward_mean 0.5", "loss -0.02", "grad_norm 3.5", "time 3.75s", "peak 5.00 GiB"]
    positions = [out.index(piece) for piece in order]
    assert positions == sorted(positions), out
    assert "clip_frac" not in out and "resident" not in out
    assert "rss 300.0 MiB" in plain(0, {"mem/rss_peak": 300 * 2**20})


def test_console_line_fits_the_terminal_dropping_the_least_telling_first():
    metrics = {**row(3), "reward_std": 0.125, "kl_mean": 0.001, "entropy": 5.5, "val/reward_mean": 0.75,
               "reward/acc": 0.5, "time/decode_step": 100.0}
    wide = plain(3, metrics, width=200)
    for piece in ("step 3", "reward_mean 0.75", "reward_std 0.125", "val/reward_mean 0.75", "loss -0.03",
                  "kl_mean 0.001", "grad_norm 4.5", "entropy 5.5", "reward/acc 0.5", "time 4.75s", "peak 5.50 GiB"):
        assert piece in wide, wide
    for width in (100, 80, 60, 40):
        line = plain(3, metrics, width=width)
        assert len(line) <= width and line.startswith("step 3  reward_mean 0.75"), line
    narrow = plain(3, metrics, width=60)
    assert "val/reward_mean" in narrow and "entropy" not in narrow and "reward/acc" not in narrow
    assert "nonfinite_steps" not in wide and "nonfinite_steps 1" in plain(3, {**metrics, "nonfinite_steps": 1})


def test_step_line_is_printed_above_the_live_progress_line(tmp_path):
    """On a terminal the live line (step n/N, the phase, the ETA) is cleared before the step's line is printed,
    which then stands on a line of its own."""
    console = Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None)
    progress = StepProgress(3, 0, enabled=True, rank=0, console=console)
    with MetricsLogger(tmp_path, backends=("console",), console=progress.console) as logger:
        progress.phase("replay")
        progress.step_done()
        logger.log(0, row(0))
    progress.close()
    pieces = re.split(r"[\r\n]", console.file.getvalue())
    [line] = [p for p in pieces if "reward_mean" in p]
    assert "ETA" not in line and Text.from_ansi(line).plain.startswith("step 0  reward_mean 0"), pieces


def test_console_times_keep_their_figures():
    # a step of 4.8 ms once printed as `0.00s`
    assert "time 4.8ms" in plain(0, {"time/capture": 0.0048})
    assert "time 210us" in plain(0, {"time/reward": 2.1e-4})
    assert "time 64.30s" in plain(0, {"time/capture": 64.3})


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


def sample(i: int) -> dict:
    return {"origin": f"data.jsonl:{i}", "prompt_tail": "...What is 2+2?", "answer": "4", "response": f"it is {i}",
            "reward": float(i), "response_tokens": 3 + i}


def test_samples_go_to_jsonl_a_wandb_table_and_tensorboard_text_and_are_cut_back_on_resume(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tables = []

    class FakeRun:
        id, dir = "abc", str(tmp_path / "wandb")

        def log(self, metrics, step):
            tables.extend((step, v) for v in metrics.values() if isinstance(v, Table))

        def finish(self):
            pass

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: FakeRun(), Table=Table))
    backends = ("jsonl", "wandb", "tensorboard")
    with MetricsLogger(tmp_path, backends=backends) as logger:
        for step in range(3):
            logger.log(step, {"loss": 0.0})
            logger.log_samples(step, [sample(step), {**sample(step + 10), "reward/format": 0.5}])
        lines = logger.destinations(samples=2)
    assert [(r["step"], r["response"]) for r in read_metrics(tmp_path / "samples.jsonl")] == [
        (0, "it is 0"), (0, "it is 10"), (1, "it is 1"), (1, "it is 11"), (2, "it is 2"), (2, "it is 12")]
    assert read_metrics(tmp_path / "samples.jsonl")[0] == {"step": 0, **sample(0)}
    assert read_metrics(tmp_path / "samples.jsonl")[1]["reward/format"] == 0.5
    step, table = tables[0]
    assert step == 0 and table.columns[:2] == ["step", "origin"] and len(table.data) == 2
    assert table.data[1][table.columns.index("response")] == "it is 10"
    # a reward's extra figure is a column of its own, empty where a row's reward did not give it
    assert table.columns[-1] == "reward/format" and [row[-1] for row in table.data] == [None, 0.5]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "samples/text_summary" in events.Tags()["tensors"]
    text = events.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "reward 10, reward/format 0.5, 13 tokens, data.jsonl:10" in text and "    it is 10" in text
    assert lines == [f"metrics: every figure of each step in {tmp_path / 'metrics.jsonl'}; up to 2 responses a step in "
                     f"{tmp_path / 'samples.jsonl'}",
                     f"tensorboard: event files in {tmp_path / 'tensorboard'} (tensorboard --logdir "
                     f"{tmp_path / 'tensorboard'})", f"wandb: run abc in {tmp_path / 'wandb'}"]
    # killed after step 2, resumed from the checkpoint of step 1; a fresh run starts the file again
    MetricsLogger(tmp_path, backends=("jsonl",), resume_step=2).close()
    assert [r["step"] for r in read_metrics(tmp_path / "samples.jsonl")] == [0, 0, 1, 1]
    MetricsLogger(tmp_path, backends=("jsonl",)).close()
    assert read_metrics(tmp_path / "samples.jsonl") == []


def test_a_step_record_keeps_its_first_samples_and_the_means_of_extra_figures():
    record = StepRecord(3)
    rendered = []

    def prompt_text(text):
        return lambda: rendered.append(text) or text

    long_prompt = "x" * 10_000 + "the question?"
    record.add(Example(long_prompt, "a", where="f:1"), prompt_text(long_prompt), ["r0", "r1"], [2, 2],
               Scores([1.0, 0.0], [{"acc": 1.0}, {"acc": 0.0, "len": 2.0}]))
    record.add(Example("p2", "b", where="f:2"), prompt_text("p2"), ["s0", "s1"], [2, 5], Scores([0.5, 0.25]))
    record.add(Example("p3", "c", where="f:3"), prompt_text("p3"), ["t0"], [1], Scores([0.0], [{"acc": 1.0}]))
    assert [(s["origin"], s["response"], s["reward"], s["response_tokens"]) for s in record.samples] == [
        ("f:1", "r0", 1.0, 2), ("f:1", "r1", 0.0, 2), ("f:2", "s0", 0.5, 2)]
    # the prompt's tail only, rendered only where a sample is kept
    assert record.samples[0]["prompt_tail"] == long_prompt[-PROMPT_TAIL_CHARS:] and rendered == [long_prompt, "p2"]
    assert record.samples[1]["reward/len"] == 2.0 and "reward/acc" not in record.samples[2]
    assert extra_means(record.extra_sums) == {"reward/acc": 2 / 3, "reward/len": 2.0}
    # two data-parallel ranks: a key one rank's rewards did not give counts where it was given
    assert extra_means(merge_sums([record.extra_sums, {"acc": [0.0, 1]}])) == {"reward/acc": 0.5, "reward/len": 2.0}
    assert StepRecord(0).samples == [] and extra_means({}) == {}


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
