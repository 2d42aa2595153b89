"""The sharded format, through torch.distributed.checkpoint (DCP): every rank writes its own shards, and a
checkpoint loads under any world size and ep (DCP reshards on load), into fsdp2, ddp or one process.

Used for `strategy=fsdp2` and for expert parallel (the strategy's `sharded_checkpoints`): no rank ever holds a
whole tensor, which the whole-tensor format (format_whole.py: gathered on every rank, written by rank 0) cannot
avoid at the 27B shape, nor at GLM-5's 256 experts. The strategy supplies the state (`sharded_state_dict`): fsdp2's
DTensor shards; under ep each expert parameter and its AdamW moments as this rank's rows of the whole [E, ...]
tensor, so the checkpoint keys them by global expert index; every other tensor whole, written once (DCP gives each
tensor that several ranks hold to one of them). On load each rank asks for what it holds and reads only that.
Layout, beside the whole-tensor checkpoints and found by the same `CheckpointManager.latest()`:

    step_00000040/
        dcp/          DCP's files: {"model": trainable weights (and saved buffers) by name, "optim": optimizer
                      state by name}
        trainer.pt    torch.save({"step": step, **trainer_state}), rank 0's, as in the whole-tensor format (every
                      rank's RNG, gathered before the save, the config and the guard's counts: trainer_state.py)
        COMPLETE      written last: JSON with the step and every file's byte size (paths under the directory)

Atomic as the whole-tensor format: all ranks write into `step_XXXXXXXX.tmp-dcp/` (one name every rank knows;
the next CheckpointManager deletes it after a kill), DCP fsyncs its files, rank 0 writes trainer.pt and COMPLETE,
renames the directory, and prunes to `keep`; barriers order the ranks. One shared filesystem for all ranks.

A checkpoint whose files are missing or not at their written size is refused before anything is read. DCP reads
into the live weights, so one whose shards fail to read is found only after part of it is in the model
(`PartlyLoaded`): resume then needs an older intact one, which overwrites all of it.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from longstraw_cli.checkpoint.atomic import TMP_TAG, fsync_dir, remove, replace_dir
from longstraw_cli.checkpoint.integrity import CheckpointError, PartlyLoaded, check_parameters, write_marker
from longstraw_cli.checkpoint.select import CheckpointManager
from longstraw_cli.checkpoint.trainer_state import read_trainer_state, save_trainer_state
from longstraw_cli.safety.errors import first_line

DCP_DIR = "dcp"
_TMP_NAME = f"{TMP_TAG}dcp"


def is_sharded(path: Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(checkpoints: CheckpointManager, step: int, strategy, trainer_state: dict) -> Path:
    """A collective: every rank calls it. -> the checkpoint's final path."""
    import torch.distributed.checkpoint as dcp

    final = checkpoints.step_dir(step)
    tmp = final.with_name(final.name + _TMP_NAME)
    if checkpoints.rank == 0:
        if tmp.exists():
            remove(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(strategy.sharded_state_dict(), storage_writer=dcp.FileSystemWriter(str(tmp / DCP_DIR), sync_files=True))
    _barrier()
    if checkpoints.rank == 0:
        save_trainer_state(tmp, step, trainer_state)
        write_marker(tmp, step)
        fsync_dir(tmp / DCP_DIR)
        replace_dir(tmp, final)
        checkpoints.prune()
    _barrier()
    return final


def load(path: Path, strategy) -> dict:
    """Loads a sharded checkpoint into the strategy's model and optimizer (each rank reads the shards it
    needs); -> trainer_state. Every rank calls it. CheckpointError: a file is missing or not at its size, before
    anything is read into the model; PartlyLoaded: a shard failed to read (on every rank: DCP gathers the
    failures); CheckpointMismatch: another model's parameters."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    trainer_state = read_trainer_state(path)
    reader = dcp.FileSystemReader(str(path / DCP_DIR))
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path / DCP_DIR}: unreadable metadata ({type(e).__name__}: {e})") from e
    saved = {k.partition(".")[2] for k in metadata.state_dict_metadata if k.startswith("model.")}
    state = strategy.sharded_state_dict()
    check_parameters(path, saved, set(state["model"]))
    # a parameter that never had a gradient (glm52's DSA indexer) has no optimizer state in the checkpoint, while
    # the fresh optimizer here was given one for every parameter: DCP is asked only for the saved ones
    with_state = {k.removeprefix("optim.state.").rpartition(".")[0] for k in metadata.state_dict_metadata
                  if k.startswith("optim.state.")}
    state["optim"]["state"] = {n: s for n, s in state["optim"]["state"].items() if n in with_state}
    try:
        dcp.load(state, storage_reader=reader)
    except (Exception, dcp.CheckpointException) as e:
        # DCP reads into the live weights and optimizer state: an older checkpoint loaded next overwrites them all
        raise PartlyLoaded(f"{path / DCP_DIR}: cannot load ({_cause(e)})") from e
    strategy.load_sharded_state_dict(state)
    return trainer_state


def _cause(error: BaseException) -> str:
    """The first failing rank's error, of DCP's CheckpointException (a BaseException holding every rank's)."""
    failures = getattr(error, "failures", None)
    if failures:
        rank = min(failures)
        error = failures[rank][0]
        return f"rank {rank}: {type(error).__name__}: {first_line(error)}"
    return f"{type(error).__name__}: {first_line(error)}"
