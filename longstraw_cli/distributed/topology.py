"""One validated topology: cp x dp = world size (ep splits experts inside the same ranks), checked once at start,
and the one place that builds process groups (`ParallelDims.new_groups` -> `ProcessGroups`).

ep must divide cp: an EP group lies inside one CP group, whose ranks hold the same prompt and responses and so
make the same collective calls; ranks of different prompts (DP) would not (rollout lengths differ).

Ranks are laid out cp-fastest: rank = dp_rank * cp + cp_rank, so the ranks of one prompt's context-parallel
group are neighbours (same node first); an EP group is ep consecutive ranks of a CP group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups, all None in one process. `ep` is None unless ep > 1 (no group of one rank per
    expert slice is built); `cp` and `dp` exist on every multi-process run, of one rank where that axis is 1."""

    cp: Any = None
    dp: Any = None
    ep: Any = None


# one process: no groups
SINGLE_PROCESS = ProcessGroups()

@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        for name in ("cp", "ep"):
            value = getattr(self, name)
            if value < 1 or self.world_size % value:
                divisors = [n for n in range(1, self.world_size + 1) if self.world_size % n == 0]
                raise ValueError(f"{name}={value} does not divide the world size {self.world_size}; valid: {divisors}")
        if self.cp % self.ep:
            divisors = [n for n in range(1, self.cp + 1) if self.cp % n == 0]
            raise ValueError(f"ep={self.ep} must divide cp={self.cp} (an EP group lies within a CP group); "
                             f"valid ep: {divisors}")

    @property
    def dp(self) -> int:
        return self.world_size // self.cp

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, cp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return rank // self.cp, rank % self.cp

    def cp_group_ranks(self, dp_rank: int) -> list[int]:
        return [dp_rank * self.cp + i for i in range(self.cp)]

    def ep_group_ranks(self, dp_rank: int, ep_index: int) -> list[int]:
        """The ep_index-th EP group of a CP group: ep consecutive CP ranks."""
        return [dp_rank * self.cp + ep_index * self.ep + i for i in range(self.ep)]

    def dp_group_ranks(self, cp_rank: int) -> list[int]:
        return [d * self.cp + cp_rank for d in range(self.dp)]

    def group_ranks(self) -> dict[str, list[list[int]]]:
        """Every group of every axis, in the order `new_groups` creates them; each axis partitions the ranks
        ("ep" is empty when ep == 1: no EP groups)."""
        return {
            "cp": [self.cp_group_ranks(d) for d in range(self.dp)],
            "dp": [self.dp_group_ranks(c) for c in range(self.cp)],
            "ep": [self.ep_group_ranks(d, e) for d in range(self.dp) for e in range(self.cp // self.ep)]
            if self.ep > 1 else [],
        }

    def new_groups(self, rank: int, timeout_s: float | None = None) -> ProcessGroups:
        """This rank's groups (all None for a world of one). new_group is collective: every rank creates every
        group, in the same order, so every rank calls this once, after init_process_group. `timeout_s`: how long
        a collective of these groups may wait (None: the backend's default); each group is named by its axis."""
        self.coords(rank)
        if self.world_size == 1:
            return ProcessGroups()
        from datetime import timedelta

        import torch.distributed as dist

        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        mine = {}
        for axis, groups in self.group_ranks().items():
            for ranks in groups:
                group = dist.new_group(ranks, timeout=timeout, group_desc=axis)
                if rank in ranks:
                    mine[axis] = group
        return ProcessGroups(**mine)


def env_rank_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) outside torchrun."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)))
