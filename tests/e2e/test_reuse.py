"""`capture.reuse_steps=K` end to end (reuse.py): K=1 is today's trainer; K=3 trains three steps on one capture and
logs its drift (0 at the first cycle, larger at a larger learning rate); `capture.max_drift` re-captures early; a
run resumed mid-reuse re-captures and continues; LoRA with a KL reference, QLoRA and two data-parallel ranks (ddp,
fsdp2) run it; what reuse cannot run with is refused in one line."""

import os
from pathlib import Path

import pytest

from conftest import rows, run_ranks

E2E = Path(__file__).parent
SMALL = ["prompt_tokens=64", "response_tokens=4", "group_size=3", "logger.backends=[jsonl]",
         "task.reward=rewards_for_tests:char_sum"]
DETERMINISTIC = ("step", "reward_mean", "reward_std", "loss", "pg_loss", "grad_norm", "entropy", "num_tokens")


@pytest.fixture
def train(train_here, tmp_path, monkeypatch):
    """-> rows of `longstraw train SMALL ARGS` in run_dir tmp_path/NAME (which must succeed); its stderr in
    `run.err`."""
    monkeypatch.syspath_prepend(str(E2E))

    def run(name: str, *args: str) -> list[dict]:
        code, _, run.err = train_here([*SMALL, *args, f"run_dir={tmp_path / name}"])
        assert code == 0, run.err
        return rows(tmp_path / name)

    return run


def _same(a: list[dict], b: list[dict]) -> None:
    assert [{k: r[k] for k in DETERMINISTIC} for r in a] == [{k: r[k] for k in DETERMINISTIC} for r in b]


def test_one_reuse_step_is_todays_trainer(train):
    today, explicit = train("today", "steps=2"), train("k1", "steps=2", "capture.reuse_steps=1")
    _same(today, explicit)
    assert [sorted(r) for r in today] == [sorted(r) for r in explicit]
    assert "reuse_cycle" not in today[0] and all("time/capture" in r for r in today)


def test_three_steps_on_one_capture_and_resume_mid_reuse(train):
    whole = train("whole", "steps=4", "capture.reuse_steps=3")
    assert [r["captures"] for r in whole] == [1, 0, 0, 1]
    assert [r["reuse_cycle"] for r in whole] == [0, 1, 2, 0]
    assert ["time/capture" in r for r in whole] == [True, False, False, True]
    assert whole[0]["drift"] == 0 and whole[1]["drift"] > 0 and whole[2]["drift"] > 0
    # the first step is today's first step: the same capture, rollout and replays
    _same(whole[:1], train("today", "steps=1"))
    # a checkpoint at step 2 (mid-reuse): the resumed run re-captures the same prompt and counts cycles from 0
    train("cut", "steps=2", "capture.reuse_steps=3")
    resumed = train("cut", "steps=4", "capture.reuse_steps=3", "resume=true")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    _same(resumed[:2], whole[:2])
    assert [r["captures"] for r in resumed[2:]] == [1, 1] and [r["reuse_cycle"] for r in resumed[2:]] == [0, 0]
    assert resumed[2]["step_prompt_tokens"] == whole[2]["step_prompt_tokens"]


def test_the_data_advances_once_per_k_steps(train, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "{"x" * n}", "answer": "a"}}\n' for n in (10, 20, 30)))
    got = train("data", "task=jsonl", f"task.path={data}", "steps=4", "capture.reuse_steps=2")
    lengths = [r["step_prompt_tokens"] for r in got]
    assert lengths[0] == lengths[1] < lengths[2] == lengths[3]
    assert [r["epoch"] for r in got] == pytest.approx([1 / 3, 1 / 3, 2 / 3, 2 / 3])


def test_drift_grows_with_the_learning_rate(train):
    drift = [train(f"lr{lr}", "steps=2", "capture.reuse_steps=2", f"optim.lr={lr}")[1]["drift"]
             for lr in (1e-3, 3e-2)]
    print(f"drift at the second cycle: lr 1e-3 {drift[0]:.3g}, lr 3e-2 {drift[1]:.3g}")
    assert 0 < drift[0] < drift[1]


def test_max_drift_recaptures_at_the_next_step(train):
    got = train("capped", "steps=3", "capture.reuse_steps=3", "capture.max_drift=0")
    assert [r["captures"] for r in got] == [1, 0, 1] and [r["reuse_cycle"] for r in got] == [0, 1, 0]
    assert f"step 2 re-captures its prompt: the drift {got[1]['drift']:.3g} of the step before" in train.err


def test_lora_with_a_kl_reference_reuses_the_capture(train):
    got = train("lora", "steps=2", "capture.reuse_steps=2", "lora.rank=4", "algo.kl_coef=0.1", "optim.lr=0.05")
    assert [r["captures"] for r in got] == [1, 0] and got[1]["drift"] > 0 and got[1]["kl_loss"] > 0


def test_blockwise_replay_reuses_the_capture(train):
    """capture.replay_block with reuse: each response (4 tokens, blocks of 3 and 1) replays block by block from the
    reused capture, and trains as the whole-response replays do (fp32): the same samples; step 0's gradient norm to
    1e-6; the later steps' gradient norms to 2e-3 and drift to 1e-2, the noise Adam makes of fp32 rounding (a
    parameter whose gradient is rounding noise moves by about lr either way; without reuse the two replays' gradient
    norms differ as much, 2.8e-4 at step 1; the drift, a difference of log-probs, 4.5e-3 at step 2)."""
    whole = train("whole", "steps=3", "capture.reuse_steps=3")
    blocks = train("blocks", "steps=3", "capture.reuse_steps=3", "capture.replay_block=3")
    assert [r["captures"] for r in blocks] == [1, 0, 0]
    for w, b in zip(whole, blocks, strict=True):
        assert (b["reward_mean"], b["num_tokens"]) == (w["reward_mean"], w["num_tokens"])
        later = w["step"] > 0
        assert b["grad_norm"] == pytest.approx(w["grad_norm"], rel=2e-3 if later else 1e-6)
        assert b["drift"] == pytest.approx(w["drift"], rel=1e-2 if later else 1e-6, abs=1e-9)


def test_qlora_reuses_the_capture(train):
    """NF4 base weights with adapters: the probe re-captures the tail through the quantised linears."""
    pytest.importorskip("torchao")
    got = train("qlora", "steps=2", "capture.reuse_steps=2", "lora.rank=4", "lora.quantize=nf4", "optim.lr=0.05")
    assert [r["captures"] for r in got] == [1, 0] and got[1]["drift"] > 0


def _two_ranks(rank, world_size, port, args):
    """A rank of a two-rank `longstraw train ARGS`, forked from this process (tests/conftest.py's run_ranks: no
    interpreter start-up, which is most of a torchrun launch on two cores)."""
    import torch

    from conftest import composed
    from longstraw_cli.config import train_config
    from longstraw_cli.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    Trainer(train_config(composed(args))).train()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_data_parallel_ranks_reuse_their_own_prompts(tmp_path, monkeypatch, strategy):
    """Each rank holds its own prompt's state; max_drift may make one rank re-capture and not the other (no
    collective depends on it: capture runs inside the step's one gather of whole weights)."""
    monkeypatch.syspath_prepend(str(E2E))
    run_ranks(_two_ranks, 2, [*SMALL, "steps=3", "capture.reuse_steps=3", "capture.max_drift=0.3",
                              f"strategy={strategy}", f"run_dir={tmp_path / 'run'}"], timeout_s=600)
    got = rows(tmp_path / "run")
    # the logged numbers are the mean over the two ranks
    assert got[0]["captures"] == 1 and got[0]["drift"] == 0 and got[1]["captures"] == 0 and got[1]["drift"] > 0


@pytest.mark.parametrize("args, expected", [
    (["capture.gradient=exact"], "capture.reuse_steps=3 with capture.gradient=exact"),
    (["prompts_per_step=2"], "needs prompts_per_step=1, got prompts_per_step=2"),
    (["capture.max_drift=-1"], "max_drift must be a finite number >= 0"),
])
def test_what_reuse_cannot_run_with_is_one_line(train_here, tmp_path, args, expected):
    code, _, err = train_here(["capture.reuse_steps=3", *args, f"run_dir={tmp_path / 'run'}"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
