"""The non-finite guard: a step whose loss or gradient norm is not finite is not applied.

The guard stands between the transaction and the strategy (`NonFiniteGuard.around(strategy)`) and changes two of
the strategy's calls:

- `backward(loss)`: a loss that is not finite is multiplied by NaN before its backward, so that rank's gradients
  are NaN. The finalized gradient norm is a reduction over every rank's gradients, so it is then NaN on every
  rank, and every rank skips the same step without a collective of the guard's own.
- `step()`: when the norm `finalize()` returned is not finite, the gradients are dropped (`zero_grad`) instead:
  weights and optimizer state stay as they were. DeepSpeed steps inside its `finalize` and skips a step whose
  norm is not finite itself (ZeRO's overflow check); the guard then only counts it.

The trainer calls `after_step` once per step, which logs and counts a skipped step, and `stop_if_due` after the
step's metrics row, which stops the run with one line after `max_in_row` skipped steps in a row. `check_finite`
keeps a non-finite parameter out of every checkpoint, whole-tensor or sharded.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from longstraw_cli.errors import RunError

log = logging.getLogger("longstraw")


class NonFiniteStop(RunError):
    """Training cannot go on: too many non-finite steps in a row, or a non-finite parameter."""

    exit_code = 3


class _Guarded:
    """The strategy as the transaction sees it: every call passes through but `backward` and `step`."""

    def __init__(self, strategy, guard: NonFiniteGuard):
        self._strategy, self._guard = strategy, guard

    def __getattr__(self, name):
        return getattr(self._strategy, name)

    def backward(self, loss: torch.Tensor) -> None:
        if not bool(torch.isfinite(loss.detach()).all()):
            self._guard.loss_finite = False
            loss = loss * float("nan")
        self._strategy.backward(loss)

    def finalize(self) -> float:
        self._guard.grad_norm = float(self._strategy.finalize())
        return self._guard.grad_norm

    def step(self) -> None:
        if math.isfinite(self._guard.grad_norm):
            self._strategy.step()
        else:
            self._strategy.zero_grad()


class NonFiniteGuard:
    """Counts the steps that were not applied; `max_in_row` of them in a row stop the run."""

    def __init__(self, max_in_row: int):
        self.max_in_row = max_in_row
        self.in_row = 0
        self.total = 0
        self.loss_finite = True
        self.grad_norm = 0.0

    def around(self, strategy):
        return _Guarded(strategy, self)

    def after_step(self, step: int) -> None:
        """Counts `step` and logs it if it was not applied; `stop_if_due` then ends the run if it is time."""
        applied = math.isfinite(self.grad_norm)
        what = "loss" if not self.loss_finite else "gradient norm"
        self.loss_finite, self.grad_norm = True, 0.0
        if applied:
            self.in_row = 0
            return
        self.in_row += 1
        self.total += 1
        log.warning("step %d not applied: its %s is not finite (%d in a row, %d in all; the run stops at %d in a row, "
                    "max_nonfinite_steps)", step, what, self.in_row, self.total, self.max_in_row)

    def stop_if_due(self, step: int) -> None:
        if self.in_row >= self.max_in_row:
            raise NonFiniteStop(
                f"stopped at step {step}: {self.in_row} steps in a row had a non-finite loss or gradient norm "
                f"(max_nonfinite_steps={self.max_in_row}); none of them was applied. Look for rewards or advantages "
                f"that overflow, or lower optim.lr, then resume=true continues from the newest checkpoint")

    def state_dict(self) -> dict:
        return {"in_row": self.in_row, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.in_row, self.total = int(state["in_row"]), int(state["total"])


def first_nonfinite(model_state: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None. Sharded weights
    (DTensors, fsdp2) are checked by this rank's shards, then the ranks agree on the answer: a collective, every
    rank calls it."""
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(t, DTensor) for t in model_state.values())
    found = None
    for name, tensor in model_state.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            found = name
            break
    if not (sharded and dist.is_initialized() and dist.get_world_size() > 1):
        return found
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, found)
    return next((name for name in every_rank if name is not None), None)


def check_finite(model_state: dict[str, torch.Tensor], step: int) -> None:
    """Raises NonFiniteStop naming a parameter with a NaN or infinite value: such a model is never saved. Every
    rank stops alike: whole tensors are the same on every rank, and sharded ones are agreed on."""
    name = first_nonfinite(model_state)
    if name is not None:
        raise NonFiniteStop(f"step {step}: parameter {name} holds a NaN or infinite value; not checkpointed, the "
                            f"newest checkpoint is the last good one (resume=true continues from it)")
