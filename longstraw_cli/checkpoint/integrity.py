"""What makes a checkpoint one to trust, in either format: its COMPLETE marker (written last, with every file's
byte size), weights that are finite (a non-finite model is never saved, and a checkpoint holding one is never
resumed), and trainable parameters that are this model's.

The errors say which: `CheckpointError` (a file missing, truncated or unreadable, or a weight not finite: resume
passes over it for an older one), `PartlyLoaded` (the same, found only after part of a sharded checkpoint was read
into the live weights), `CheckpointMismatch` (an intact checkpoint of another model), `ResumeError` (one this
run cannot continue: a structural config change, a format the strategy cannot read).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw_cli.safety.errors import RunError
from longstraw_cli.safety.guard import NonFiniteStop

COMPLETE_FILE = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or unreadable; the message names the file."""


class PartlyLoaded(CheckpointError):
    """A damaged sharded checkpoint whose damage showed only once part of it was in the live weights."""


class CheckpointMismatch(ValueError):
    """An intact checkpoint of another model: its trainable parameters are not this model's."""


class ResumeError(RunError):
    """A run_dir's checkpoint cannot be continued with this config (or this strategy)."""


def write_marker(directory: Path, step: int) -> None:
    """COMPLETE, written last: the step and the byte size of every file under `directory` (paths relative to it)."""
    sizes = {str(f.relative_to(directory)): f.stat().st_size for f in sorted(directory.rglob("*")) if f.is_file()}
    with open(directory / COMPLETE_FILE, "w") as f:
        json.dump({"step": step, "sizes": sizes}, f)
        f.flush()
        os.fsync(f.fileno())


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE_FILE).is_file()


def verify_marker(path: Path) -> None:
    """CheckpointError, naming the file, unless the marker is there and every file it lists is at its size."""
    path = Path(path)
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {marker} is missing")
    try:
        sizes = json.loads(marker.read_text())["sizes"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{marker}: unreadable marker ({e})") from e
    for name, size in sizes.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f}: expected {size} bytes, found {f.stat().st_size} (truncated or replaced)")


def read(f: Path, loader):
    """loader(f), any failure a CheckpointError naming the file."""
    try:
        return loader(f)
    except Exception as e:
        raise CheckpointError(f"{f}: cannot load ({type(e).__name__}: {e})") from e


def check_parameters(path: Path, saved: set[str], expected: set[str]) -> None:
    """CheckpointMismatch unless the checkpoint at `path` holds exactly the trainable parameters `expected`."""
    if saved != expected:
        raise CheckpointMismatch(f"{path} does not match this model's trainable parameters "
                                 f"(e.g. {sorted(saved ^ expected)[:3]})")


def first_nonfinite(model_state: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None. Sharded weights
    (DTensors: fsdp2's shards, the experts under ep) are checked by this rank's shards, then the ranks agree on
    the answer: a collective, every rank calls it."""
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(t, DTensor) for t in model_state.values())
    found = None
    for name, tensor in model_state.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_floating_point() and not _finite(local):
            found = name
            break
    if not (sharded and dist.is_initialized() and dist.get_world_size() > 1):
        return found
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, found)
    return next((name for name in every_rank if name is not None), None)


def _finite(t: torch.Tensor) -> bool:
    """Whether every value is finite, with no temporary the size of `t` (isfinite makes a float and three bool
    ones: 1.4x an fp64 tensor): min and max propagate NaN, and an infinity is one of them."""
    if t.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())


def check_finite(model_state: dict[str, torch.Tensor], step: int) -> None:
    """Raises NonFiniteStop naming a parameter with a NaN or infinite value: such a model is never saved. Every
    rank stops alike: whole tensors are the same on every rank, and sharded ones are agreed on."""
    name = first_nonfinite(model_state)
    if name is not None:
        raise NonFiniteStop(f"step {step}: parameter {name} holds a NaN or infinite value; not checkpointed, the "
                            f"newest checkpoint is the last good one (resume=true continues from it)")
