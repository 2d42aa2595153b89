"""The whole-tensor format: the trainable weights and the optimizer state as one process holds them, written by
rank 0 (ddp, deepspeed, one process; the strategy's `state_dict` gathers them on every rank first).

    step_00000040/
        model.safetensors   model_state (tensors made contiguous, on CPU; storages shared by tied weights cloned)
        optimizer.pt        torch.save(optimizer_state)
        trainer.pt          torch.save({"step": step, **trainer_state}) (trainer_state.py)
        COMPLETE            written last: JSON with the step and every file's byte size (integrity.py)

Built in `step_XXXXXXXX.tmp-<pid>/` and renamed into place (atomic.py). Files are loaded with
`torch.load(weights_only=True)`, so trainer_state may hold only tensors, numbers, strings, None and
lists/tuples/dicts of them. An ep=1 checkpoint of glm52 holds every expert whole: `load_state_dict` under ep > 1
keeps each rank's rows of it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from longstraw_cli.checkpoint import integrity
from longstraw_cli.checkpoint.atomic import atomic_directory, fsync_file, torch_save
from longstraw_cli.checkpoint.select import CheckpointManager
from longstraw_cli.checkpoint.trainer_state import load_trainer_state, save_trainer_state

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


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


def save(checkpoints: CheckpointManager, step: int, *, model_state: dict[str, torch.Tensor], optimizer_state: dict,
         trainer_state: dict) -> Path | None:
    """Writes step_{step:08d}/ atomically and prunes to `keep`; returns its path (None on ranks other than 0).

    State must already be whole (gathered) on rank 0: this function does no collective."""
    final = checkpoints.step_dir(step)
    if checkpoints.rank != 0:
        return None
    if trainer_state.get("step", step) != step:
        raise ValueError(f"trainer_state['step'] = {trainer_state['step']} but save was called with step {step}")
    # saving a step twice (a resume that re-saves) replaces the older copy
    with atomic_directory(final) as tmp:
        save_file(_safetensors_ready(model_state), str(tmp / MODEL_FILE), metadata={"step": str(step)})
        fsync_file(tmp / MODEL_FILE)
        torch_save(optimizer_state, tmp / OPTIMIZER_FILE)
        save_trainer_state(tmp, step, trainer_state)
        integrity.write_marker(tmp, step)
    checkpoints.prune()
    return final


def load(path: Path, map_location: str | torch.device = "cpu") -> tuple[dict, dict, dict]:
    """(model_state, optimizer_state, trainer_state) of a complete checkpoint. Model and optimizer tensors go
    to map_location; trainer_state (RNG states included) always loads on CPU, as the RNG setters need.
    CheckpointError, naming the file, if one is missing, not at its written size or unreadable."""
    path = Path(path)
    integrity.verify_marker(path)
    device = str(map_location)
    model_state = integrity.read(path / MODEL_FILE, lambda f: load_file(str(f), device=device))
    optimizer_state = integrity.read(
        path / OPTIMIZER_FILE, lambda f: torch.load(f, map_location=map_location, weights_only=True))
    return model_state, optimizer_state, load_trainer_state(path)

