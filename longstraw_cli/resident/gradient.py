"""Exact mode's gradient of the resident state (`capture.gradient=exact`).

response_only replay treats the resident state as a constant: no gradient reaches the parameters through the
prompt's keys, values and recurrent state. Exact mode keeps that gradient without a graph over the prompt:

1. While the G responses replay, they read a VIEW of the resident state whose differentiable fields (each state
   kind's `GRAD_FIELDS`) are autograd leaves; what each backward accumulates into a leaf is added into one
   buffer per field (`StateGrad`, in the compute dtype: fp32 for bf16 pages) and dropped at once, so at most one
   layer's page-sized gradient exists beside the buffer.
2. After the last replay the model walks the prompt once in reverse, block by block (`CausalLM.prompt_backward`):
   each block is recomputed with autograd from what it read at capture (the pages before it, viewed as leaves
   that drain into the buffer, and the CARRIED states at its start, kept at capture as `Resident.boundaries`);
   the buffer's gradient of the block's own pages and the carried-state gradient from the block after it are
   backpropagated into it; the block's graph is freed before the block before it is recomputed.

Memory: the buffer (the size of the differentiable pages, in the compute dtype), the boundary states, one
block's graph. Compute: about one more forward and one backward over the prompt.

Where the walk finds what it reads is the model's `prompt_placement_fn` (a hook): `WholePrompt` here, every page
and boundary on this device; context parallel swaps in `distributed.cp_walk.ShardedPrompt`, whose pages,
buffers and boundaries are split over the ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from longstraw_cli.resident.state import Resident
from longstraw_kernels import compute_dtype

GRADIENT_MODES = ("response_only", "exact")


def check_gradient_mode(mode: str) -> None:
    if mode not in GRADIENT_MODES:
        raise ValueError(f"gradient={mode!r}; valid: {list(GRADIENT_MODES)}")


def leaves(state, targets: dict[str, torch.Tensor]):
    """A copy of a layer state whose fields named in `targets` are autograd leaves over the same storage (no copy);
    every gradient autograd accumulates into one is added into targets[name] (same shape) and dropped."""
    out = {}
    for name, target in targets.items():
        leaf = getattr(state, name).detach().requires_grad_()
        leaf.register_post_accumulate_grad_hook(_drain_into(target))
        out[name] = leaf
    return dataclasses.replace(state, **out)


def _drain_into(target: torch.Tensor):
    def drain(leaf: torch.Tensor) -> None:
        # None where a kernel's backward gave this input no gradient (the flash path over zero pages)
        if leaf.grad is not None:
            target.add_(leaf.grad)
            leaf.grad = None
    return drain


class StateGrad:
    """The gradient of the loss w.r.t. one resident state: per layer, one buffer per differentiable field, the
    shape of the field, in its compute dtype (fp32 for bf16/fp32 pages, fp64 for fp64), zero at the start."""

    def __init__(self, resident: Resident):
        if resident.offload is not None:
            raise ValueError(f"exact gradients need the resident state on the device; got offload={resident.offload!r}")
        self.layers = [{name: torch.zeros_like(getattr(state, name), dtype=compute_dtype(getattr(state, name)))
                        for name in state.GRAD_FIELDS} for state in resident.layers]

    def replay_view(self, resident: Resident) -> Resident:
        """The resident state as the replays read it: the same tensors, as leaves draining into these buffers."""
        return dataclasses.replace(resident, layers=[leaves(state, grads)
                                                     for state, grads in zip(resident.layers, self.layers)])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for grads in self.layers for t in grads.values())


class WholePrompt:
    """Where the reverse walk reads on one device: every page and every block boundary of `resident` is here.
    The walk asks, per block [start, end): `num_before(start)` (how many of this device's pages lie before it: a
    prefix of them), `block_grads(grad, start, end)` (per layer the gradient of the pages the block writes:
    views into the buffer; None for carried layers) and `boundary(block, start)` (the carried states at its
    start; None for paged layers)."""

    # the prompt position of this device's first page
    first = 0

    def __init__(self, resident: Resident):
        self.resident = resident

    def num_before(self, start: int) -> int:
        return start

    def block_grads(self, grad: StateGrad, start: int, end: int) -> list[dict[str, torch.Tensor] | None]:
        return [None if state.CARRIED else {name: t[start:end] for name, t in grads.items()}
                for state, grads in zip(self.resident.layers, grad.layers)]

    def boundary(self, block: int, start: int) -> list:
        return self.resident.boundaries[block]

    def carried_at(self, start: int, states: list) -> list:
        """The carried states at prompt position `start`, kept as `states` (here they are)."""
        return states
