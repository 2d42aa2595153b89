"""Exact mode (`capture.gradient=exact`) under context parallel: the prompt's reverse walk over sharded pages.

Rank r of the CP group holds the pages of its contiguous shard [first_r, end_r) of the P captured tokens
(`shard_bounds`), the exact-mode gradient buffer of those pages only (`StateGrad`), and the carried GDN states
at the starts of the capture blocks that start in its shard (`Resident.boundaries`: None for the other blocks;
kept by the capture's span hooks, cp_gdn.py's `SpanBoundaries`).

The walk (`CausalLM.prompt_backward`) is the one-device walk REPLICATED on every rank over the GLOBAL block
sequence, as replay is replicated: every rank recomputes every block, so the dense compute of the walk
(projections, MLP or experts, the GDN scans, the indexer's queries) runs on every rank, and every rank ends with
the same parameter gradients, those of one rank. What is split is the prompt's attention: a block's queries
attend to each rank's own pages before the block through the context-parallel attention hooks (qwen36:
`cp_replay_attention`; glm52: `cp_pages_attention` after the global top-k, the range from `cp_block_range`),
whose backward all-reduces dq and leaves each rank the gradient of its own pages, which drains into its own
buffer. `ShardedPrompt` is the walk's `prompt_placement_fn`; per block [start, end) it gives:
- `num_before(start)`: this rank's pages before the block, a prefix of its shard (all, some or none of it);
- `block_grads(grad, start, end)`: the gradient of the pages the block writes, complete on their owners once
  every later block has been walked: each rank that owns part of [start, end) broadcasts its part of every
  paged layer's buffer (one broadcast per owner, usually one: a block straddles a shard boundary rarely);
- `boundary(block, start)`: the carried states at the block's start, broadcast by the rank whose shard holds
  position `start` (nothing for a model without carried layers).
The carried (GDN) state gradient is replicated like the walk.

Cost per rank, against one device: the walk's whole dense compute (not 1/N of it), 1/N of the prompt
attention, the buffer and the boundaries of its shard (1/N of both), plus per block the received gradient of the
block's pages (all paged layers, [block, ...] in the compute dtype; absent on the owner when it owns the whole
block) and one boundary's carried states in transit. Communication per block: the block's page gradient once,
one boundary's carried states, and the collectives of the attention hooks (dq all-reduces; glm52: the top-k
candidates and a tiny all-gather of page counts per layer).

Legend: N ranks in the CP group, T tokens of the block.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from longstraw_cli.distributed.comm import rank_world, shard_bounds
from longstraw_cli.resident import Resident
from longstraw_cli.resident.gradient import StateGrad

__all__ = ["ShardedPrompt", "broadcast_tensors", "owned_blocks"]


def owned_blocks(num_tokens: int, block_size: int, first: int, end: int) -> list[int]:
    """The capture blocks of a prompt of `num_tokens` tokens whose start lies in the shard [first, end)."""
    return [b for b in range(-(-num_tokens // block_size)) if first <= b * block_size < end]


def broadcast_tensors(tensors: list[torch.Tensor], src: int, group) -> list[torch.Tensor]:
    """The tensors of group rank `src`, on every rank: `src` passes its own (returned as they are), the others
    tensors of the same shapes and dtypes (their values unused). One broadcast, packed in the widest dtype
    (exact: every narrower float is representable in it)."""
    rank, _ = rank_world(group)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if rank == src:
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    else:
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
    if rank == src:
        return tensors
    parts = flat.split([t.numel() for t in tensors])
    return [part.view(t.shape).to(t.dtype) for part, t in zip(parts, tensors)]


class ShardedPrompt:
    """`CausalLM.prompt_placement_fn` under context parallel (see the module doc); `resident` is this rank's."""

    def __init__(self, resident: Resident, *, group):
        self.resident, self.group = resident, group
        self.rank, world = rank_world(group)
        self.bounds = [shard_bounds(resident.num_tokens, world, r) for r in range(world)]
        self.first, self.end = self.bounds[self.rank]
        self.paged = [i for i, state in enumerate(resident.layers) if not state.CARRIED]
        self.carried = [i for i, state in enumerate(resident.layers) if state.CARRIED]

    def num_before(self, start: int) -> int:
        return min(max(start - self.first, 0), self.end - self.first)

    def owner(self, position: int) -> int:
        """The rank whose shard holds prompt position `position`."""
        return next(r for r, (first, last) in enumerate(self.bounds) if first <= position < last)

    def block_grads(self, grad: StateGrad, start: int, end: int) -> list[dict[str, torch.Tensor] | None]:
        """Per layer the gradient of the block's pages [start, end) ({field: [T, ...]}; None for carried layers),
        the same on every rank: each owner of a part broadcasts that part of every paged layer's buffer."""
        keys = [(i, name) for i in self.paged for name in grad.layers[i]]
        out = [None if state.CARRIED else {} for state in self.resident.layers]
        if not keys:
            return out
        parts = {key: [] for key in keys}
        for owner, (first, last) in enumerate(self.bounds):
            lo, hi = max(first, start), min(last, end)
            if lo >= hi:
                continue
            if owner == self.rank:
                mine = [grad.layers[i][name][lo - first : hi - first] for i, name in keys]
            else:
                mine = [grad.layers[i][name].new_empty((hi - lo, *grad.layers[i][name].shape[1:]))
                        for i, name in keys]
            for key, part in zip(keys, broadcast_tensors(mine, owner, self.group)):
                parts[key].append(part)
        for (i, name), pieces in parts.items():
            out[i][name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out

    def boundary(self, block: int, start: int) -> list:
        """The carried states at the block's start (None for paged layers), from the rank whose shard holds it."""
        return self.carried_at(start, self.resident.boundaries[block])

    def carried_at(self, start: int, states: list | None) -> list:
        """The carried states at prompt position `start` (None for paged layers), the same on every rank: `states`
        as the rank whose shard holds `start` kept them (the others' are not read), broadcast from it."""
        out = [None] * len(self.resident.layers)
        if not self.carried:
            return out
        owner = self.owner(start)
        states = states if owner == self.rank else self.resident.layers
        names = [[f.name for f in dataclasses.fields(states[i])] for i in self.carried]
        mine = [getattr(states[i], name) for i, fields in zip(self.carried, names) for name in fields]
        received = iter(broadcast_tensors(mine, owner, self.group))
        for i, fields in zip(self.carried, names):
            out[i] = dataclasses.replace(self.resident.layers[i], **{name: next(received) for name in fields})
        return out
