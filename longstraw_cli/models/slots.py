"""Response slots that grow with the decode: the buffers of the generated tokens' keys, per response.

A decode of up to R = max_new_tokens tokens does not preallocate R slots: it starts at `chunk` slots
(rollout.native.response_chunk) and doubles, capped at R, when its step counter reaches the capacity (the rollout
loop looks at its Python step index: no host synchronisation). A response that stops early holds, and a
static-shaped step reads under its validity mask, at most twice the slots it used (or the first chunk), not R.
A growth reallocates each buffer with zeros past its old slots and copies the old ones in, one buffer at a time, so
that the old and new copies of only one buffer coexist. Growing costs a copy of what was written (O(R) in all over
the doubling) and, for a step replayed as a CUDA graph, a new capture (rollout/native.py's GraphedStep): at most
ceil(log2(R / chunk)) of them.

`response_capacities` is the schedule the decoders follow and `longstraw plan` counts (its last entry is R itself:
the decode's worst case holds the preallocated R slots, plus one buffer's old copy while the last growth copies it).

Legend: B responses, S response slots (the capacity).
"""

from __future__ import annotations

import torch


def grown_capacity(capacity: int, max_new_tokens: int) -> int:
    """The response slots after one growth: twice as many, at most max_new_tokens."""
    return min(2 * capacity, max_new_tokens)


def response_capacities(max_new_tokens: int, chunk: int | None) -> list[int]:
    """Every capacity a decode of max_new_tokens tokens passes through, first to last (chunk None: one, all of
    them)."""
    capacities = [min(chunk or max_new_tokens, max_new_tokens)]
    while capacities[-1] < max_new_tokens:
        capacities.append(grown_capacity(capacities[-1], max_new_tokens))
    return capacities


def slot_buffer(batch: int, capacity: int, *row: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros [batch, capacity, *row]. The capacity is a dynamic size of a compiled decode step (as the page count,
    qwen36/decode.py), so that a growth re-captures the step's graph without compiling it again."""
    buf_BS_ = torch.zeros(batch, capacity, *row, dtype=dtype, device=device)
    torch._dynamo.maybe_mark_dynamic(buf_BS_, 1)
    return buf_BS_


def grown(old_BS_: torch.Tensor, capacity: int) -> torch.Tensor:
    """A buffer of `capacity` slots holding `old_BS_`'s in its first ones, zeros after."""
    new_BS_ = slot_buffer(old_BS_.shape[0], capacity, *old_BS_.shape[2:], dtype=old_BS_.dtype, device=old_BS_.device)
    new_BS_[:, : old_BS_.shape[1]].copy_(old_BS_)
    return new_BS_


class ResponseSlots:
    """One layer's per-response buffers of the generated tokens, [B, capacity, ...] each: the attributes that
    `SLOTS` names (None where the layer has no such keys). The static decode steps write slot `step` themselves;
    the eager decode (core.StepDecoder) `append`s, after the `length` slots written."""

    SLOTS: tuple[str, ...] = ()
    length = 0

    def append(self, *blocks_BT_: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """The blocks (one per SLOTS name, in order; None where the buffer is None) written after the `length`
        slots written before. -> every buffer's written slots (views), None where the buffer is None."""
        end = self.length + blocks_BT_[0].shape[1]
        views = []
        for name, block_BT_ in zip(self.SLOTS, blocks_BT_, strict=True):
            buffer_BS_ = getattr(self, name)
            if buffer_BS_ is not None:
                buffer_BS_[:, self.length : end].copy_(block_BT_)
            views.append(None if buffer_BS_ is None else buffer_BS_[:, :end])
        self.length = end
        return tuple(views)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, name) for name in self.SLOTS) if t is not None]

    def grow(self, capacity: int) -> None:
        """Every buffer moved to `capacity` slots, one at a time (rebinding the attribute frees the old one)."""
        for name in self.SLOTS:
            if getattr(self, name) is not None:
                setattr(self, name, grown(getattr(self, name), capacity))
