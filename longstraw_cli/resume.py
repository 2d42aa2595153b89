"""What a checkpoint holds beyond weights and optimizer, and what `resume=true` does with it.

- Every rank's RNG (`gather_rng`, a collective; rank 0 writes them all): data-parallel ranks sample with their own
  generators, so one rank's states restored on every rank would make a resumed run differ from an uninterrupted
  one from its first step. The data position is the step (example index step * dp + dp_rank).
- The config the checkpoint was written under (JSON). On resume the changed keys are listed in the log; optimizer
  hyperparameters take their new values (`optimizer_hyperparameters`); a change of what the saved tensors mean
  (STRUCTURAL) is refused with one line.
- `newest_intact`: a checkpoint whose files are missing, truncated or unreadable, or whose weights are not finite,
  is skipped with a warning naming it; the newest intact one is loaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw_cli.checkpoint import CheckpointError, CheckpointManager, capture_rng, restore_rng
from longstraw_cli.distributed.topology import ParallelDims
from longstraw_cli.errors import RunError
from longstraw_cli.guard import first_nonfinite

log = logging.getLogger("longstraw")

# keys whose change makes the saved tensors mean something else: refused on resume
STRUCTURAL = ("model.name", "model.path", "lora.rank", "lora.alpha", "lora.target_modules")
# optimizer hyperparameters: the optimizer takes the new values on resume
OPTIMIZER = ("optim.lr", "optim.betas", "optim.weight_decay")
# keys that differ between a run and its resumption by design (a run_dir may also have been moved or copied)
_IGNORED = ("resume", "run_dir")


class ResumeError(RunError):
    """A run_dir's checkpoint cannot be continued with this config."""


def gather_rng(generators: dict[str, torch.Generator]) -> list[dict]:
    """Every rank's RNG states, by global rank (a collective over all ranks)."""
    state = capture_rng(generators)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [state]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def restore_own_rng(trainer_state: dict, rank: int, dims: ParallelDims, generators: dict[str, torch.Generator]) -> None:
    """This rank's RNG states from a checkpoint: its own where the layout is the one it was saved under, else those
    of the first rank of the same data-parallel index (a warning says the run then differs from an uninterrupted
    one). Checkpoints written before per-rank states held rank 0's only."""
    if "rng_by_rank" not in trainer_state:
        restore_rng(trainer_state["rng"], generators)
        return
    states, saved = trainer_state["rng_by_rank"], trainer_state["dims"]
    saved_dims = ParallelDims(int(saved["world_size"]), cp=int(saved["cp"]))
    dp_rank, _ = dims.coords(rank)
    if (saved_dims.world_size, saved_dims.cp) == (dims.world_size, dims.cp):
        source = rank
    else:
        source = (dp_rank % saved_dims.dp) * saved_dims.cp
        if saved_dims.dp != dims.dp:
            log.warning("checkpoint written by %d data-parallel ranks, resumed on %d: prompts and samples differ "
                        "from an uninterrupted run's", saved_dims.dp, dims.dp)
    restore_rng(states[source], generators)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_json(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def check_config(path: Path, saved_json: str | None, config: dict) -> None:
    """Logs the config keys that changed since the checkpoint; raises ResumeError on a structural change."""
    if saved_json is None:
        log.warning("%s holds no config (written by an older version): changes since it are not checked", path.name)
        return
    saved, now = _flat(json.loads(saved_json)), _flat(json.loads(config_json(config)))
    changed = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now))
               if saved.get(k) != now.get(k) and k not in _IGNORED}
    structural = [k for k in STRUCTURAL if k in changed]
    if structural:
        key = structural[0]
        old, new = changed[key]
        raise ResumeError(f"resume from {path}: {key} changed from {old!r} to {new!r}, which changes what the "
                          f"checkpoint's tensors mean; put back {key}={json.dumps(old)} or start a new run_dir")
    if not changed:
        return
    log.info("resume from %s: config changed since the checkpoint: %s", path.name,
             ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items()))
    taken = [k for k in OPTIMIZER if k in changed]
    if taken:
        log.info("resume: the optimizer takes the new %s", ", ".join(f"{k}={changed[k][1]!r}" for k in taken))


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer, hyperparameters: dict) -> None:
    """The configured hyperparameters on every parameter group, over those a loaded state dict brought back."""
    for group in optimizer.param_groups:
        group.update(hyperparameters)


def newest_intact(checkpoints: CheckpointManager, map_location) -> tuple[Path, tuple[dict, dict, dict]] | None:
    """(path, (model_state, optimizer_state, trainer_state)) of the newest checkpoint that loads and holds finite
    weights, or None; each one passed over is named in a warning."""
    for path in reversed(checkpoints.complete()):
        try:
            states = checkpoints.load(path, map_location=map_location)
        except CheckpointError as e:
            log.warning("resume: skipping %s: %s", path, e)
            continue
        bad = first_nonfinite(states[0])
        if bad is not None:
            log.warning("resume: skipping %s: parameter %s is not finite", path, bad)
            continue
        return path, states
    return None
