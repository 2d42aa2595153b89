"""Which checkpoints a run has and which one to resume: the complete ones under `run_dir/checkpoints/`, the newest
first, and the newest of them that loads whole (`newest_intact`).

    run_dir/checkpoints/
        step_00000040/            a complete checkpoint of either format (its COMPLETE marker is there)
        step_00000050.tmp-<pid>/  a write or a deletion that was killed: never returned, deleted by the next manager

One writer per run_dir: rank 0 writes, renames and prunes (to `keep`); every rank may list and read.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from longstraw_cli.checkpoint.atomic import TMP_TAG, fsync_dir, remove
from longstraw_cli.checkpoint.integrity import CheckpointError, PartlyLoaded, ResumeError, is_complete

log = logging.getLogger("longstraw")

_STEP_DIR = re.compile(r"step_(\d+)")


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


class CheckpointManager:
    """The checkpoints of a run: where step N's goes, the complete ones, the newest, and pruning to `keep`.

    Only rank 0 creates or deletes anything (`prune`, the clean-up of killed writes here); `complete` and `latest`
    work on every rank. The formats (format_whole.py, format_sharded.py) write into `step_dir(step)`.
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
                if TMP_TAG in stale.name and stale.is_dir():
                    shutil.rmtree(stale)

    def step_dir(self, step: int) -> Path:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.dir / f"step_{step:08d}"

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(step, p) for p in self.dir.iterdir() if (step := _step_of(p)) is not None and is_complete(p)]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest checkpoint with its COMPLETE marker; temp and half-written directories are ignored."""
        done = self.complete()
        return done[-1] if done else None

    def prune(self) -> None:
        """Deletes all but the newest `keep` complete checkpoints (rank 0, after a save)."""
        for old in self.complete()[: -self.keep]:
            remove(old)
        fsync_dir(self.dir)


def newest_intact(checkpoints: CheckpointManager, load: Callable[[Path], dict]) -> tuple[Path, dict] | None:
    """(path, load(path)) of the newest checkpoint that `load` takes whole, or None; each one it passes over
    (CheckpointError) is named in a warning. A sharded one found damaged after part of it was read into the
    weights (PartlyLoaded) needs an older intact one to overwrite them: with none, ResumeError."""
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
