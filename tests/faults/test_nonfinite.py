"""Poisoned runs: a step whose loss or gradient norm is not finite is not applied, counted, and stops the run after
max_nonfinite_steps in a row; a non-finite parameter is never checkpointed; values that cannot be right are refused
at start."""

import math
from pathlib import Path

import pytest
import torch

from conftest import rows
from longstraw_cli.checkpoint import CheckpointManager, format_whole
from longstraw_cli.distributed.strategy import LocalStrategy
from longstraw_cli.models import build_model
from longstraw_cli.rl.losses import LossConfig
from longstraw_cli.transaction import Transaction, TransactionConfig

SMALL = ["prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]", "steps=1"]
E2E = Path(__file__).parent.parent / "e2e"


@pytest.mark.parametrize("override, expected", [
    ("optim.lr=inf", "optim.lr must be a finite number > 0, got inf"),
    ("optim.lr=nan", "optim.lr must be a finite number > 0, got nan"),
    ("optim.max_grad_norm=-1", "optim.max_grad_norm must be > 0 (null: no clipping), got -1"),
    ("optim.max_grad_norm=0", "optim.max_grad_norm must be > 0"),
    ("optim.weight_decay=inf", "optim.weight_decay must be a finite number >= 0, got inf"),
])
def test_values_that_cannot_be_right_are_refused_at_start(train_here, tmp_path, override, expected):
    code, _, err = train_here([*SMALL, override, f"run_dir={tmp_path / 'run'}"])
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_nonfinite_step_leaves_weights_and_optimizer_state_untouched(one_thread):
    from longstraw_cli.safety.guard import NonFiniteGuard

    torch.manual_seed(0)
    model = build_model("qwen36_tiny", dtype=torch.float64)
    strategy = LocalStrategy(model, torch.optim.AdamW(model.parameters(), lr=1e-2), max_grad_norm=1.0)
    guard = NonFiniteGuard(max_in_row=2)
    tx = Transaction(model, guard.around(strategy), LossConfig(name="grpo"), TransactionConfig(block_size=16))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 259, (16,), generator=g)
    responses = [torch.randint(0, 259, (4,), generator=g) for _ in range(3)]

    def run(rewards):
        return tx.run(prompt, responses, torch.tensor(rewards, dtype=torch.float64), tx.capture(prompt))

    run([0.0, 1.0, 0.5])
    guard.after_step(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {k: v.clone() for k, v in strategy.optimizer.state_dict()["state"][0].items()}
    # finite rewards whose advantages overflow: the loss is NaN
    result = run([1e308, 1e308, 0.0])
    guard.after_step(1)
    assert math.isnan(result.stats["loss"]) and math.isnan(result.stats["grad_norm"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(v, moments[k]) for k, v in strategy.optimizer.state_dict()["state"][0].items())
    assert all(p.grad is None for p in model.parameters())
    assert (guard.in_row, guard.total) == (1, 1)


def test_an_applied_step_ends_the_streak_and_max_in_row_stop_the_run():
    from longstraw_cli.safety.guard import NonFiniteGuard, NonFiniteStop

    guard = NonFiniteGuard(max_in_row=2)
    for step, norm in enumerate([math.nan, 1.0, math.inf, math.nan]):
        guard.grad_norm = norm
        guard.after_step(step)
        if step < 3:
            guard.stop_if_due(step)
    assert (guard.in_row, guard.total) == (2, 3)
    with pytest.raises(NonFiniteStop, match="stopped at step 3: 2 steps in a row"):
        guard.stop_if_due(3)


def test_a_nonfinite_parameter_is_never_checkpointed():
    from longstraw_cli.checkpoint.integrity import check_finite
    from longstraw_cli.safety.guard import NonFiniteStop

    with pytest.raises(NonFiniteStop, match="parameter b holds a NaN or infinite value; not checkpointed"):
        check_finite({"a": torch.ones(2), "b": torch.tensor([1.0, math.inf])}, step=3)


def test_overflowing_reward_stops_the_run_and_the_last_checkpoint_stays_good(train_here, tmp_path, monkeypatch):
    """The issue's case: a finite reward of 1e308 from step 2 on made the loss NaN; the NaN weights were
    checkpointed and, with checkpoint.keep=1, the last good checkpoint pruned."""
    monkeypatch.syspath_prepend(str(E2E))
    run = tmp_path / "run"
    code, _, err = train_here([*SMALL, "steps=8", "checkpoint.every=1", "checkpoint.keep=1",
                               "task.reward=rewards_for_tests:overflow_from_example_2", f"run_dir={run}"])
    assert code == 3, err
    assert "step 2 not applied: its loss is not finite" in err
    assert err.strip().splitlines()[-1].startswith("longstraw: error: stopped at step 4: 3 steps in a row")
    logged = rows(run)
    assert [r["step"] for r in logged] == [0, 1, 2, 3, 4]
    assert [r["nonfinite_steps"] for r in logged] == [0, 0, 1, 2, 3]
    assert all(math.isfinite(r["grad_norm"]) for r in logged[:2]) and math.isnan(logged[2]["loss"])
    checkpoints = CheckpointManager(run)
    [newest] = checkpoints.complete()
    model_state, optimizer_state, _ = format_whole.load(newest)
    # written after step 3 (not applied): the weights of step 1, the last one applied
    assert newest.name == "step_00000004"
    assert all(torch.isfinite(t).all() for t in model_state.values())
    assert all(torch.isfinite(v).all() for s in optimizer_state["state"].values() for v in s.values())
    assert int(optimizer_state["state"][0]["step"]) == 2


def test_a_step_not_applied_does_not_advance_the_lr_schedule(train_here, tmp_path, monkeypatch):
    """The schedule is a function of the steps applied (schedule.py): steps 2-4 are not, so their rate is step 2's."""
    from longstraw_cli.schedule import lr_factor

    monkeypatch.syspath_prepend(str(E2E))
    run = tmp_path / "run"
    code, _, err = train_here([*SMALL, "steps=5", "max_nonfinite_steps=5", "optim.warmup_steps=4",
                               "task.reward=rewards_for_tests:overflow_from_example_2", f"run_dir={run}"])
    assert code == 0, err
    logged = rows(run)
    assert [r["nonfinite_steps"] for r in logged] == [0, 0, 1, 2, 3]
    assert [r["lr"] for r in logged] == [0.01 * lr_factor(applied, total_steps=5, warmup_steps=4, schedule="constant")
                                         for applied in (0, 1, 2, 2, 2)]
