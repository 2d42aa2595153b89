"""LongStraw kernels: each op's torch reference beside its GPU versions.

`compute_dtype` is the one precision rule of every op and of the model code: fp32 at least, wider when an input is
(fp64 tests then test the algorithm, not fp32 rounding). The other helpers serve every op that has a Triton kernel:
the run's `kernels` config picks auto (the kernel where it applies) or torch (the reference everywhere; config.py),
and the kernel's module is imported on first use only. `missing_fast_paths` says what a GPU run without an optional
package (fla, Triton) runs instead, and what that costs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging

import torch

from longstraw_kernels.config import KernelConfig, kernel_choice, kernels, use_kernels

__all__ = ["FAST_PATHS", "KernelConfig", "at_least_fp32", "compute_dtype", "kernel_choice", "kernels",
           "missing_fast_paths", "needs_grad", "optional_module", "say_once", "use_kernels"]


def compute_dtype(*inputs: torch.Tensor | torch.dtype | None) -> torch.dtype:
    """fp32, or the widest input dtype when wider (bf16/fp16 compute in fp32, fp64 stays fp64). Inputs are tensors
    or dtypes; None is skipped."""
    dtype = torch.float32
    for x in inputs:
        if x is not None:
            dtype = torch.promote_types(dtype, x if isinstance(x, torch.dtype) else x.dtype)
    return dtype


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in `compute_dtype(x)`: HF computes norms, gates and logits in fp32."""
    return x.to(compute_dtype(x))


def needs_grad(*inputs: torch.Tensor | None) -> bool:
    """Whether a call on these inputs records a graph (autograd on, an input requiring grad; None is skipped): the
    graph-free forwards' kernels (capture, scoring) serve only where it does not."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


log = logging.getLogger(__name__)


_SAID: set[str] = set()


def say_once(message: str, *, key: str | None = None, level: int = logging.WARNING) -> None:
    """A line a process logs once (a warning unless `level` says otherwise), however many times it is asked: a fast
    path that does not serve, said by each rollout's decoder. `key` names the line where its text varies (a count
    in it); the text is the key by default."""
    key = message if key is None else key
    if key not in _SAID:
        _SAID.add(key)
        log.log(level, message)


# what a test calls to forget what was said
say_once.cache_clear = _SAID.clear


@functools.cache
def optional_module(name: str):
    """The module `name`, or None where it does not import: no Triton (CPU installs), or a Triton build that does
    not match this torch. Imported lazily, once: CPU runs never need it."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the torch reference
        log.warning("%s unavailable, using the torch reference: %s", name, exc)
        return None


@dataclasses.dataclass(frozen=True)
class FastPath:
    """An optional package whose kernels a GPU run uses, and the line a run without it gets."""

    module: str
    # what runs instead, what that costs, how to install it
    missing: str


# a family names the ones its GPU path runs (FamilySpec.fast_paths); the costs are docs/BENCHMARKS.md's
FAST_PATHS = {
    "fla": FastPath("fla.ops.gated_delta_rule", (
        "fla (flash-linear-attention) is not installed: Gated DeltaNet capture, scoring and decode run on the torch "
        "references (gdn_chunked, gdn_recurrent: many small kernels; the torch chunked GDN measured 27x slower than "
        "a Triton GDN kernel at 64K tokens, forward + backward); pip install flash-linear-attention")),
    "triton": FastPath("triton", (
        "Triton does not import: LongStraw's Triton kernels (GDN replay backward, prompt-page dq, sparse MLA, DSA "
        "scores, NF4, the decode's response attention, linears, sampling, GDN step and DSA top-k) run on their "
        "torch references (the GDN backward measured 27x slower at 64K tokens) and the decode step is not compiled; "
        "install the Triton build that matches this torch")),
}


def is_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def missing_fast_paths(names, device: torch.device) -> list[str]:
    """The line of each fast path in `names` (FAST_PATHS keys) whose package does not import, for a run on
    `device`; none off the GPU, where the torch references are the path."""
    if not is_gpu(device):
        return []
    lines = []
    for name in names:
        try:
            importlib.import_module(FAST_PATHS[name].module)
        except Exception:  # noqa: BLE001 - not installed, or a build that does not match: the fallback runs
            lines.append(FAST_PATHS[name].missing)
    return lines
