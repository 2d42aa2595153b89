"""What a checkpoint holds beyond weights and optimizer, and what `resume=true` does with it.

- Every rank's RNG (`gather_rng`, a collective; rank 0 writes them all): data-parallel ranks sample with their own
  generators, so one rank's states restored on every rank would make a resumed run differ from an uninterrupted
  one from its first step. The data position is the step (example index (step * prompts_per_step + b) * dp +
  dp_rank), and the lr schedule's is the step less the steps the non-finite guard skipped (its counts are saved).
- The config the checkpoint was written under (JSON). On resume the changed keys are listed in the log; optimizer
  hyperparameters take their new values (`optimizer_hyperparameters`; the trainer's `set_lr` then sets each step's
  rate from the new optim.lr and schedule); a change of what the saved tensors mean (STRUCTURAL) is refused with
  one line.
- `newest_intact`: a checkpoint whose files are missing, truncated or unreadable, or whose weights are not finite,
  is skipped with a warning naming it; the newest intact one is loaded.
- Both formats, whole tensors (checkpoint.py) and shards (fsdp2, ep > 1: distributed/sharded_checkpoint.py), hold the
  same trainer_state and go through `load_checkpoint`. The sharded format's one difference: DCP reads into the
  live weights, so a checkpoint whose shards fail to read or hold non-finite weights is found bad only once part
  of it is loaded (`PartlyLoaded`); an older intact one then overwrites all of it, and with none left resume stops
  with one line instead of training from step 0 on those weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw_cli.checkpoint import CheckpointError, CheckpointManager, capture_rng, check_parameters, restore_rng
from longstraw_cli.distributed import sharded_checkpoint
from longstraw_cli.distributed.sharded_checkpoint import PartlyLoaded
from longstraw_cli.distributed.topology import ParallelDims
from longstraw_cli.errors import RunError
from longstraw_cli.guard import first_nonfinite

log = logging.getLogger("longstraw")

# keys whose change makes the saved tensors mean something else: refused on resume
STRUCTURAL = ("model.name", "model.path", "model.override_config", "lora.rank", "lora.alpha", "lora.target_modules",
              "lora.quantize")
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


def _at(tree: dict, key: str):
    """The value at a dotted key of a nested config, {} where a mapping is absent (written before it existed)."""
    for part in key.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree


def config_json(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def check_config(path: Path, saved_json: str | None, config: dict) -> None:
    """Logs the config keys that changed since the checkpoint; raises ResumeError on a structural change."""
    if saved_json is None:
        log.warning("%s holds no config (written by an older version): changes since it are not checked", path.name)
        return
    saved_tree, now_tree = json.loads(saved_json), json.loads(config_json(config))
    saved, now = _flat(saved_tree), _flat(now_tree)
    # checkpoints written before lora.quantize existed were all of unquantised models
    saved.setdefault("lora.quantize", "none")
    changed = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now))
               if saved.get(k) != now.get(k) and k not in _IGNORED}
    # a mapping (model.override_config) is flattened into its keys: a change of any of them is its change
    structural = [key for key in STRUCTURAL if any(k == key or k.startswith(f"{key}.") for k in changed)]
    if structural:
        key = structural[0]
        old, new = changed[key] if key in changed else (_at(saved_tree, key), _at(now_tree, key))
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


def newest_intact(checkpoints: CheckpointManager, load: Callable[[Path], dict]) -> tuple[Path, dict] | None:
    """(path, load(path)) of the newest checkpoint that `load` (`load_checkpoint`) takes whole, or None; each one
    it passes over (CheckpointError) is named in a warning."""
    partly = None
    for path in reversed(checkpoints.complete()):
        try:
            return path, load(path)
        except CheckpointError as e:
            log.warning("resume: skipping %s: %s", path, e)
            partly = partly or (path if isinstance(e, PartlyLoaded) else None)
    if partly is not None:
        raise ResumeError(f"resume: no intact checkpoint in {checkpoints.dir}, and {partly.name} was partly read "
                          f"into the weights before its damage showed; start a new run_dir")
    return None


def load_checkpoint(path: Path, checkpoints: CheckpointManager, strategy, config: dict, map_location) -> dict:
    """Checkpoint `path`, of either format, into the strategy's model and optimizer -> its trainer_state.
    CheckpointError: files missing, truncated or unreadable, or weights not finite (`newest_intact` passes over
    it); ResumeError: `config` cannot continue it; CheckpointMismatch: another model's trainable parameters."""
    if sharded_checkpoint.is_sharded(path):
        if strategy.name == "deepspeed":
            raise ResumeError(f"{path} is a sharded (fsdp2 or ep) checkpoint: it resumes under fsdp2, ddp or one "
                              f"process, not deepspeed")
        check_config(path, sharded_checkpoint.read_trainer_state(path).get("config"), config)
        trainer_state = sharded_checkpoint.load(path, strategy)
        # a collective under fsdp2 and ep: the ranks agree on their shards
        bad = first_nonfinite(strategy.sharded_model_state())
        if bad is not None:
            raise PartlyLoaded(f"parameter {bad} is not finite")
        return trainer_state
    model_state, optimizer_state, trainer_state = checkpoints.load(path, map_location=map_location)
    bad = first_nonfinite(model_state)
    if bad is not None:
        raise CheckpointError(f"parameter {bad} is not finite")
    check_config(path, trainer_state.get("config"), config)
    check_parameters(path, set(model_state), {n for n, p in strategy.model.named_parameters() if p.requires_grad})
    strategy.load_state_dict(model_state, optimizer_state)
    return trainer_state
