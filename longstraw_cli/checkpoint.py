"""Checkpoint and resume: a run killed at any moment continues from its newest complete checkpoint with the
numbers an uninterrupted run would have produced.

Layout, under `run_dir/checkpoints/`:

    step_00000040/
        model.safetensors   model_state (tensors made contiguous, on CPU; storages shared by tied weights cloned)
        optimizer.pt        torch.save(optimizer_state)
        trainer.pt          torch.save({"step": step, **trainer_state}); put capture_rng(...) in trainer_state
        COMPLETE            written last: JSON with the step and every file's byte size

A checkpoint is built in `step_XXXXXXXX.tmp-<pid>/`, every file fsynced, COMPLETE written last, then the
directory is renamed to its final name with os.replace, so a kill leaves either a complete checkpoint or a
`.tmp-` directory that `latest()` never returns and the next `CheckpointManager` deletes. Old checkpoints are
renamed to a `.tmp-` name before they are deleted, for the same reason.

Simplifications: one writer per run_dir (rank 0); state is saved whole, not sharded: with CP or DeepSpeed the
caller gathers the full model and optimizer state on every rank (a collective) before calling `save`, and puts a
barrier after it if other ranks read the checkpoint (fsdp2 and expert parallel write sharded checkpoints instead:
distributed/sharded_checkpoint.py). Files are loaded with `torch.load(weights_only=True)`, so
trainer_state may hold only tensors, numbers, strings, None and lists/tuples/dicts of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG is captured only where it exists
    np = None

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_FILE = "trainer.pt"
COMPLETE_FILE = "COMPLETE"
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP_TAG = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or unreadable; the message names the file."""


class CheckpointMismatch(ValueError):
    """An intact checkpoint of another model: its trainable parameters are not this model's."""


def check_parameters(path: Path, saved: set[str], expected: set[str]) -> None:
    """CheckpointMismatch unless the checkpoint at `path` holds exactly the trainable parameters `expected`."""
    if saved != expected:
        raise CheckpointMismatch(f"{path} does not match this model's trainable parameters "
                                 f"(e.g. {sorted(saved ^ expected)[:3]})")


# ---------------------------------------------------------------- RNG


def capture_rng(generators: dict[str, torch.Generator]) -> dict:
    """Every RNG a run draws from: python `random`, numpy (if importable), torch CPU, torch CUDA (all devices,
    only if CUDA is initialised) and the named generators the trainer owns. Values are tensors and plain
    Python objects, loadable with torch.load(weights_only=True)."""
    state = {
        "python": random.getstate(),
        "torch_cpu": torch.get_rng_state(),
        "generators": {name: g.get_state() for name, g in generators.items()},
    }
    if np is not None:
        np_state = np.random.get_state(legacy=False)
        np_state["state"]["key"] = torch.from_numpy(np_state["state"]["key"].astype(np.int64))
        state["numpy"] = np_state
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator]) -> None:
    """Puts back what `capture_rng` captured; `generators` must name exactly the generators that were saved."""
    saved, given = set(state["generators"]), set(generators)
    if saved != given:
        raise ValueError(
            f"generator names differ from the checkpoint: saved {sorted(saved)}, given {sorted(given)} "
            f"(missing {sorted(saved - given)}, unknown {sorted(given - saved)})"
        )
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch_cpu"].cpu())
    for name, g in generators.items():
        g.set_state(state["generators"][name].cpu())
    if "numpy" in state and np is not None:
        np_state = dict(state["numpy"], state=dict(state["numpy"]["state"]))
        np_state["state"]["key"] = np_state["state"]["key"].numpy().astype(np.uint32)
        np.random.set_state(np_state)
    if "torch_cuda" in state and torch.cuda.is_available():
        cuda_states = state["torch_cuda"]
        if len(cuda_states) != torch.cuda.device_count():
            raise ValueError(
                f"checkpoint holds CUDA RNG states of {len(cuda_states)} devices, this process sees "
                f"{torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])


def _as_tuple(x):
    # random.setstate wants tuples; a state that went through a list-producing serializer comes back as lists
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------- files


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # makes a rename or a new directory entry durable; not every filesystem allows fsync on a directory
    try:
        _fsync_file(path)
    except OSError:
        pass


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _safetensors_ready(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors; a tensor whose storage was already seen (tied embeddings, views) is cloned, since
    safetensors refuses tensors that share memory."""
    out, seen = {}, set()
    for name, t in model_state.items():
        t = t.detach().to("cpu").contiguous()
        key = t.untyped_storage().data_ptr()
        if key in seen:
            t = t.clone()
        seen.add(key)
        out[name] = t
    return out


def _remove(path: Path) -> None:
    """Renames to a `.tmp-` name first, so a kill halfway through deletion never leaves a partial checkpoint
    under a checkpoint's name."""
    doomed = path.with_name(f"{path.name}{_TMP_TAG}{os.getpid()}-del")
    os.replace(path, doomed)
    shutil.rmtree(doomed)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """A fresh `<final>.tmp-<pid>` directory beside `final` to write into; on a clean exit it is fsynced and
    renamed to `final` (an existing `final` is moved to a `.tmp-` name and deleted first), so readers see the
    old directory or the new one whole, never a part. On an error the temp directory is deleted."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}{_TMP_TAG}{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_dir(tmp)
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------- manager


class CheckpointManager:
    """Writes atomic checkpoints under run_dir/checkpoints, keeps the newest `keep`, finds the newest complete one.

    Only rank 0 writes: on other ranks `save` is a no-op and nothing is created or deleted. `latest` and `load`
    work on every rank.
    """

    def __init__(self, run_dir: Path, keep: int = 2, rank: int = 0):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.rank = rank
        if rank == 0 and self.dir.is_dir():
            # leftovers of a killed save or delete; one writer per run_dir, so none of them is in progress
            for stale in self.dir.iterdir():
                if _TMP_TAG in stale.name and stale.is_dir():
                    shutil.rmtree(stale)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [
            (step, p) for p in self.dir.iterdir()
            if (step := _step_of(p)) is not None and (p / COMPLETE_FILE).is_file()
        ]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest checkpoint with its COMPLETE marker; temp and half-written directories are ignored."""
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, *, model_state: dict[str, torch.Tensor], optimizer_state: dict,
             trainer_state: dict) -> Path | None:
        """Writes step_{step:08d}/ atomically and prunes to `keep`; returns its path (None on ranks other than 0).

        State must already be whole (gathered) on rank 0: this function does no collective."""
        if self.rank != 0:
            return None
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if trainer_state.get("step", step) != step:
            raise ValueError(f"trainer_state['step'] = {trainer_state['step']} but save was called with step {step}")
        final = self.dir / f"step_{step:08d}"
        # saving a step twice (a resume that re-saves) replaces the older copy
        with atomic_directory(final) as tmp:
            save_file(_safetensors_ready(model_state), str(tmp / MODEL_FILE), metadata={"step": str(step)})
            _fsync_file(tmp / MODEL_FILE)
            _torch_save(optimizer_state, tmp / OPTIMIZER_FILE)
            _torch_save({**trainer_state, "step": step}, tmp / TRAINER_FILE)
            sizes = {name: (tmp / name).stat().st_size for name in (MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE)}
            with open(tmp / COMPLETE_FILE, "w") as f:
                json.dump({"step": step, "sizes": sizes}, f)
                f.flush()
                os.fsync(f.fileno())

        for old in self.complete()[: -self.keep]:
            _remove(old)
        _fsync_dir(self.dir)
        return final

    def load(self, path: Path, map_location: str | torch.device = "cpu") -> tuple[dict, dict, dict]:
        """(model_state, optimizer_state, trainer_state) of a complete checkpoint. Model and optimizer tensors go
        to map_location; trainer_state (RNG states included) always loads on CPU, as the RNG setters need."""
        path = Path(path)
        marker = path / COMPLETE_FILE
        if not marker.is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint: {marker} is missing")
        try:
            sizes = json.loads(marker.read_text())["sizes"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{marker}: unreadable marker ({e})") from e
        for name, size in sizes.items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"{f}: missing")
            if f.stat().st_size != size:
                raise CheckpointError(f"{f}: expected {size} bytes, found {f.stat().st_size} (truncated or replaced)")

        device = str(map_location)
        model_state = self._read(path / MODEL_FILE, lambda f: load_file(str(f), device=device))
        optimizer_state = self._read(
            path / OPTIMIZER_FILE, lambda f: torch.load(f, map_location=map_location, weights_only=True)
        )
        trainer_state = self._read(path / TRAINER_FILE, lambda f: torch.load(f, map_location="cpu", weights_only=True))
        return model_state, optimizer_state, trainer_state

    @staticmethod
    def _read(f: Path, loader):
        try:
            return loader(f)
        except Exception as e:
            raise CheckpointError(f"{f}: cannot load ({type(e).__name__}: {e})") from e
