"""LongStraw kernels (imported as `longstraw_kernels`): each op's torch reference beside its GPU versions.

The helpers below serve every op that has a Triton kernel: an environment variable picks auto (the kernel where it
applies) or torch (the reference everywhere), and the kernel's module is imported on first use only.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

KERNEL_CHOICES = ("auto", "torch")

log = logging.getLogger(__name__)


def kernel_choice(env_var: str) -> str:
    """auto | torch from `env_var` (default auto); any other value is an error naming the valid ones."""
    choice = os.environ.get(env_var, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{env_var}={choice!r}; valid: {list(KERNEL_CHOICES)}")
    return choice


@functools.cache
def optional_module(name: str):
    """The module `name`, or None where it does not import: no Triton (CPU installs), or a Triton build that does
    not match this torch. Imported lazily, once: CPU runs never need it."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the torch reference
        log.warning("%s unavailable, using the torch reference: %s", name, exc)
        return None
