"""Checkpoint and resume: a run killed at any moment continues from its newest intact checkpoint with the numbers an
uninterrupted run would have produced. This package is the one owner of checkpointing; the strategy only supplies
and takes state dicts (`state_dict` / `load_state_dict` whole, `sharded_state_dict` / `load_sharded_state_dict`
for DCP, and `sharded_checkpoints`, which of the two it gives).

    save(checkpoints, step, strategy, trainer_state)   every rank calls it; a non-finite model is never saved
    load(path, strategy, config, map_location)         one checkpoint, either format, into the strategy
    resume(checkpoints, strategy, config, map_location) the newest intact one loaded, or None
    CheckpointManager(run_dir).latest()                 the newest complete one

The files, each one concern:
- format_whole.py    whole tensors written by rank 0 (ddp, deepspeed, one process)
- format_sharded.py  each rank's shards through torch.distributed.checkpoint (fsdp2; ep > 1: experts by global row)
- trainer_state.py   what both formats hold beside the tensors: every rank's RNG, the config, its checks on resume
- integrity.py       the COMPLETE marker and file sizes, finite weights, the parameter names; the errors
- select.py          the complete checkpoints of a run, the newest, pruning to `keep`, the newest intact one
- atomic.py          fsynced files and directories renamed into place, so a kill leaves no partial checkpoint
"""

from __future__ import annotations

from pathlib import Path

from longstraw_cli.checkpoint import format_sharded, format_whole
from longstraw_cli.checkpoint.atomic import atomic_directory
from longstraw_cli.checkpoint.integrity import (
    COMPLETE_FILE,
    CheckpointError,
    CheckpointMismatch,
    PartlyLoaded,
    ResumeError,
    check_finite,
    check_parameters,
    first_nonfinite,
)
from longstraw_cli.checkpoint.select import CheckpointManager, newest_intact
from longstraw_cli.checkpoint.trainer_state import check_config, read_trainer_state

__all__ = ["COMPLETE_FILE", "CheckpointError", "CheckpointManager", "CheckpointMismatch", "PartlyLoaded",
           "ResumeError", "atomic_directory", "load", "resume", "save"]


def save(checkpoints: CheckpointManager, step: int, strategy, trainer_state: dict) -> Path | None:
    """Checkpoint `step` in the format the strategy's state dicts take -> its path (None on ranks other than 0 of
    the whole-tensor format). A collective under fsdp2, deepspeed and ep: every rank calls it. NonFiniteStop on
    every rank alike if a weight is not finite: nothing is written."""
    if strategy.sharded_checkpoints:
        # each rank checks and writes its shards (collectives)
        check_finite(strategy.sharded_model_state(), step)
        return format_sharded.save(checkpoints, step, strategy, trainer_state)
    # whole tensors (a collective under deepspeed: every rank is here)
    model_state, optimizer_state = strategy.state_dict()
    # every rank holds the same whole tensors: every rank stops here alike
    check_finite(model_state, step)
    return format_whole.save(checkpoints, step, model_state=model_state, optimizer_state=optimizer_state,
                             trainer_state=trainer_state)


def load(path: Path, strategy, config: dict, map_location) -> dict:
    """Checkpoint `path`, of either format, into the strategy's model and optimizer -> its trainer_state.
    CheckpointError: files missing, truncated or unreadable, or weights not finite (`resume` passes over it);
    ResumeError: `config` cannot continue it; CheckpointMismatch: another model's trainable parameters.
    A whole-tensor checkpoint loads under any strategy and ep (each rank keeps its rows of the experts); a sharded
    one under any world size and ep, but not into deepspeed."""
    if format_sharded.is_sharded(path):
        if strategy.name == "deepspeed":
            raise ResumeError(f"{path} is a sharded (fsdp2 or ep) checkpoint: it resumes under fsdp2, ddp or one "
                              f"process, not deepspeed")
        check_config(path, read_trainer_state(path).get("config"), config)
        trainer_state = format_sharded.load(path, strategy)
        # a collective under fsdp2 and ep: the ranks agree on their shards
        bad = first_nonfinite(strategy.sharded_model_state())
        if bad is not None:
            raise PartlyLoaded(f"parameter {bad} is not finite")
        return trainer_state
    model_state, optimizer_state, trainer_state = format_whole.load(path, map_location=map_location)
    bad = first_nonfinite(model_state)
    if bad is not None:
        raise CheckpointError(f"parameter {bad} is not finite")
    check_config(path, trainer_state.get("config"), config)
    check_parameters(path, set(model_state), {n for n, p in strategy.model.named_parameters() if p.requires_grad})
    strategy.load_state_dict(model_state, optimizer_state)
    return trainer_state


def resume(checkpoints: CheckpointManager, strategy, config: dict, map_location) -> tuple[Path, dict] | None:
    """(path, trainer_state) of the newest checkpoint that loads whole into the strategy, or None where the run has
    none; every one passed over is named in a warning (select.newest_intact)."""
    return newest_intact(checkpoints, lambda path: load(path, strategy, config, map_location))
