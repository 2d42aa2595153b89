"""Small helpers shared by the parallel paths (CP attention / GDN / top-k, EP)."""

from __future__ import annotations

import torch.distributed as dist


def rank_world(group=None) -> tuple[int, int]:
    """(this rank in `group`, the group's size); (0, 1) without an initialised process group, so single-device
    runs need no special path."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
