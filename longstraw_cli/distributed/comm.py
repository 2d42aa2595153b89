"""Small helpers shared by the parallel paths (CP attention / GDN / top-k / walk, EP)."""

from __future__ import annotations

import torch.distributed as dist


def rank_world(group=None) -> tuple[int, int]:
    """(this rank in `group`, the group's size); (0, 1) without an initialised process group, so single-device
    runs need no special path."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_bounds(num_tokens: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """Context parallel's contiguous, near-equal shards of the captured prompt: [start, end) of rank `rank`; the
    first num_tokens % num_ranks ranks get one token more."""
    base, extra = divmod(num_tokens, num_ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)
