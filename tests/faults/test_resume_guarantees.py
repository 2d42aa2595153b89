"""Resume that is what it says: across two data-parallel ranks (ddp, fsdp2: whole-tensor and sharded checkpoints)
a resumed run logs and ends with exactly what an uninterrupted one does (every rank's RNG is in the checkpoint);
changed config keys are listed and optimizer hyperparameters take their new values; a structural change is refused
with one line; a corrupt newest checkpoint, of either format, is passed over, with a warning naming it, for the
newest intact one."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import composed, free_ports, rows, run_ranks
from longstraw_cli.checkpoint import CheckpointError, CheckpointManager, format_sharded, format_whole
from longstraw_cli.checkpoint.format_whole import OPTIMIZER_FILE

E2E = Path(__file__).parent.parent / "e2e"
SMALL = ["prompt_tokens=64", "response_tokens=4", "group_size=3", "logger.backends=[jsonl]",
         "task.reward=rewards_for_tests:char_sum"]
DETERMINISTIC = ("step", "reward_mean", "reward_std", "loss", "pg_loss", "grad_norm", "entropy", "num_tokens")


def _config(overrides: list[str]):
    from longstraw_cli.config import train_config

    return train_config(composed(overrides))


def _two_ranks(rank, world_size, port, out_dir, strategy, ports):
    """Each rank: an uninterrupted run of 3 steps, a run of 1 step, then that run resumed to 3 steps."""
    from longstraw_cli.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    for (name, steps, resume), run_port in zip([("whole", 3, False), ("part", 1, False), ("part", 3, True)], ports):
        os.environ["MASTER_PORT"] = str(run_port)
        Trainer(_config([*SMALL, f"strategy={strategy}", f"steps={steps}", f"resume={str(resume).lower()}",
                         f"run_dir={Path(out_dir) / name}"])).train()


def _weights(checkpoint: Path) -> dict:
    """A checkpoint's trainable weights, whole, in one process: fsdp2's sharded format through DCP."""
    from longstraw_cli.distributed.local_strategy import LocalStrategy
    from longstraw_cli.models import build_model

    if not format_sharded.is_sharded(checkpoint):
        return format_whole.load(checkpoint)[0]
    model = build_model("qwen36_tiny")
    strategy = LocalStrategy(model, torch.optim.AdamW(model.parameters()), max_grad_norm=None)
    format_sharded.load(checkpoint, strategy)
    return strategy.state_dict()[0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_rank_resume_equals_the_uninterrupted_run(train_here, tmp_path, monkeypatch, strategy):
    monkeypatch.syspath_prepend(str(E2E))
    run_ranks(_two_ranks, 2, str(tmp_path), strategy, free_ports(3), timeout_s=600)
    whole, part = rows(tmp_path / "whole"), rows(tmp_path / "part")
    assert len(whole) == len(part) == 3 and all(r["grad_norm"] > 0 for r in whole)
    assert [{k: r[k] for k in DETERMINISTIC} for r in part] == [{k: r[k] for k in DETERMINISTIC} for r in whole]
    final = [_weights(tmp_path / name / "checkpoints" / "step_00000003") for name in ("whole", "part")]
    assert all(torch.equal(final[0][n], final[1][n]) for n in final[0])
    if strategy != "fsdp2":
        return
    # sharded: a shard of the newest checkpoint rewritten with garbage of its size fails only as DCP reads it,
    # into the live weights; resume passes over it to step 1's, which overwrites them (one process here)
    newest = tmp_path / "part" / "checkpoints" / "step_00000003"
    shard = sorted((newest / "dcp").glob("*.distcp"))[0]
    shard.write_bytes(b"x" * shard.stat().st_size)
    code, _, err = train_here([*SMALL, "strategy=fsdp2", "steps=4", f"run_dir={tmp_path / 'part'}",
                               "resume=true"])
    assert code == 0, err
    assert f"resume: skipping {newest}: {newest / 'dcp'}: cannot load" in err
    assert "starting at step 1 of 4" in (tmp_path / "part" / "train_rank0.log").read_text()


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished 2-step run with a checkpoint after each step (keep=2)."""
    from longstraw_cli.trainer import Trainer

    run = tmp_path_factory.mktemp("two_steps") / "run"
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(_config(["prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]",
                         "steps=2", "checkpoint.every=1", f"run_dir={run}"])).train()
    finally:
        torch.set_num_threads(num_threads)
    return run


@pytest.fixture
def copy_of(tmp_path):
    def copy(run: Path) -> Path:
        return Path(shutil.copytree(run, tmp_path / "run"))
    return copy


ARGS = ["prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]"]


def test_changed_lr_is_listed_and_taken_by_the_optimizer(train_here, one_thread, two_steps, copy_of):
    run = copy_of(two_steps)
    code, _, err = train_here([*ARGS, "steps=3", "checkpoint.every=1", "optim.lr=0.05", f"run_dir={run}",
                               "resume=true"])
    assert code == 0, err
    log = (run / "train_rank0.log").read_text()
    assert "config changed since the checkpoint: optim.lr 0.01 -> 0.05, steps 2 -> 3" in log
    assert "the optimizer takes the new optim.lr=0.05" in log
    saved = torch.load(run / "checkpoints" / "step_00000003" / OPTIMIZER_FILE, weights_only=True)
    assert [g["lr"] for g in saved["param_groups"]] == [0.05]


@pytest.mark.parametrize("override, key", [("lora.rank=4", "lora.rank"), ("model=glm52_tiny", "model.name"),
                                           ("model.override_config={num_hidden_layers:2}", "model.override_config")])
def test_structural_change_is_refused_with_one_line(train_here, one_thread, two_steps, copy_of, override, key):
    run = copy_of(two_steps)
    code, _, err = train_here([*ARGS, "steps=3", override, f"run_dir={run}", "resume=true"])
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{key} changed from" in lines[0] and "start a new run_dir" in lines[0], err


def test_corrupt_newest_checkpoint_is_skipped_for_the_newest_intact_one(train_here, one_thread, two_steps, copy_of):
    run = copy_of(two_steps)
    newest = run / "checkpoints" / "step_00000002"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, _, err = train_here([*ARGS, "steps=3", "checkpoint.every=1", f"run_dir={run}", "resume=true"])
    assert code == 0, err
    assert f"resume: skipping {newest}" in err and "model.safetensors" in err
    assert "starting at step 1 of 3" in (run / "train_rank0.log").read_text()
    assert [r["step"] for r in rows(run)] == [0, 1, 2]


def test_a_partly_loaded_sharded_checkpoint_needs_an_intact_older_one(tmp_path):
    """A sharded checkpoint found damaged only once part of it was read into the weights is passed over for an
    older intact one; with none left resume stops rather than train from step 0 on those weights."""
    from longstraw_cli.checkpoint import PartlyLoaded, ResumeError
    from longstraw_cli.checkpoint.select import newest_intact

    checkpoints = CheckpointManager(tmp_path)
    for step in (1, 2):
        (checkpoints.dir / f"step_{step:08d}").mkdir(parents=True)
        (checkpoints.dir / f"step_{step:08d}" / "COMPLETE").write_text("{}")

    def newest_partly(path):
        if path.name == "step_00000002":
            raise PartlyLoaded("a shard did not read")
        return {"step": 1}

    assert newest_intact(checkpoints, newest_partly) == (checkpoints.dir / "step_00000001", {"step": 1})

    def all_damaged(path):
        raise PartlyLoaded("a shard did not read") if path.name == "step_00000002" else CheckpointError("truncated")

    with pytest.raises(ResumeError, match="step_00000002 was partly read into the weights"):
        newest_intact(checkpoints, all_damaged)
