"""Writes that a kill leaves whole or absent: fsynced files, directories renamed into place, deletions that never
leave a part under a checkpoint's name.

A directory is built under a `.tmp-` name beside its final one, every file fsynced, then renamed with os.replace;
readers (`select.CheckpointManager`, and the export and LoRA directories that use `atomic_directory` too) never
look at a `.tmp-` name, and the next `CheckpointManager` deletes the leftovers of a killed write.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

TMP_TAG = ".tmp-"


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    # makes a rename or a new directory entry durable; not every filesystem allows fsync on a directory
    try:
        fsync_file(path)
    except OSError:
        pass


def torch_save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def remove(path: Path) -> None:
    """Renames to a `.tmp-` name first, so a kill halfway through deletion never leaves a partial checkpoint
    under a checkpoint's name."""
    doomed = path.with_name(f"{path.name}{TMP_TAG}{os.getpid()}-del")
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def replace_dir(tmp: Path, final: Path) -> None:
    """`tmp`, written and fsynced, becomes `final` (an existing `final` is removed first)."""
    fsync_dir(tmp)
    if final.exists():
        remove(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """A fresh `<final>.tmp-<pid>` directory beside `final` to write into; on a clean exit it is fsynced and
    renamed to `final` (an existing `final` is moved to a `.tmp-` name and deleted first), so readers see the
    old directory or the new one whole, never a part. On an error the temp directory is deleted."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}{TMP_TAG}{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
