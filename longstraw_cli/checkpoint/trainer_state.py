"""What a checkpoint holds beyond weights and optimizer (`trainer.pt`, the same in both formats), and what
`resume=true` does with it.

- Every RNG the run draws from (`capture_rng`), of every rank (`gather_rng`, a collective; rank 0 writes them
  all): data-parallel ranks sample with their own generators, so one rank's states restored on every rank would
  make a resumed run differ from an uninterrupted one from its first step. The data position is the step
  (example index (step * prompts_per_step + b) * dp + dp_rank), and the lr schedule's is the step less the steps
  the non-finite guard skipped (its counts are saved).
- The config the checkpoint was written under (JSON). On resume the changed keys are listed in the log; optimizer
  hyperparameters take their new values (`optimizer_hyperparameters`; the trainer's `set_lr` then sets each step's
  rate from the new optim.lr and schedule); a change of what the saved tensors mean (STRUCTURAL) is refused with
  one line.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw_cli.checkpoint.atomic import torch_save
from longstraw_cli.checkpoint.integrity import ResumeError, read, verify_marker
from longstraw_cli.distributed.topology import ParallelDims

try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG is captured only where it exists
    np = None

log = logging.getLogger("longstraw")

TRAINER_FILE = "trainer.pt"


def save_trainer_state(directory: Path, step: int, trainer_state: dict) -> None:
    torch_save({**trainer_state, "step": step}, directory / TRAINER_FILE)


def load_trainer_state(path: Path) -> dict:
    """trainer.pt of the checkpoint at `path`, on CPU (as the RNG setters need); CheckpointError if unreadable."""
    return read(Path(path) / TRAINER_FILE, lambda f: torch.load(f, map_location="cpu", weights_only=True))


def read_trainer_state(path: Path) -> dict:
    """The trainer_state of a checkpoint, once every file is there at the size written; CheckpointError (naming
    the file) if not. Read before any weight, so that a config change is refused before the model is touched."""
    verify_marker(path)
    return load_trainer_state(path)


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


# ---------------------------------------------------------------- config
# keys whose change makes the saved tensors mean something else: refused on resume
STRUCTURAL = ("model.name", "model.path", "model.override_config", "lora.rank", "lora.alpha", "lora.target_modules",
              "lora.quantize")
# optimizer hyperparameters: the optimizer takes the new values on resume
OPTIMIZER = ("optim.lr", "optim.betas", "optim.weight_decay")
# keys that differ between a run and its resumption by design (a run_dir may also have been moved or copied)
_IGNORED = ("resume", "run_dir")


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
