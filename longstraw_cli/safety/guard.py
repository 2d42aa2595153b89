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
step's metrics row, which stops the run with one line after `max_in_row` skipped steps in a row. A non-finite
parameter never reaches a checkpoint, of either format (`checkpoint.integrity.check_finite` raises NonFiniteStop).
"""

from __future__ import annotations

import logging
import math

import torch

from longstraw_cli.safety.errors import RunError

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

