"""ParallelDims: cp x ep x dp checked against the world size once, and every process group (cp, dp, ep) built in
one place: on paper (`group_ranks`) and on gloo CPU ranks (`new_groups`), where each group must sum exactly its
own ranks."""

import os

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks
from longstraw_cli.distributed.topology import ParallelDims, ProcessGroups


@pytest.mark.parametrize("world, cp, ep", [(1, 1, 1), (4, 1, 1), (4, 2, 1), (4, 2, 2), (8, 4, 2), (8, 8, 4)])
def test_every_axis_partitions_the_world(world, cp, ep):
    dims = ParallelDims(world, cp=cp, ep=ep)
    groups = dims.group_ranks()
    for axis, size in (("cp", cp), ("dp", world // cp), ("ep", ep)):
        if axis == "ep" and ep == 1:
            assert groups["ep"] == []
            continue
        assert sorted(r for g in groups[axis] for r in g) == list(range(world)), axis
        assert all(len(g) == size for g in groups[axis]), axis
    for rank in range(world):
        dp_rank, cp_rank = dims.coords(rank)
        [cp_group] = [g for g in groups["cp"] if rank in g]
        [dp_group] = [g for g in groups["dp"] if rank in g]
        # cp-fastest: a CP group is consecutive ranks; a DP group takes one rank of each CP group
        assert cp_group == dims.cp_group_ranks(dp_rank) == list(range(dp_rank * cp, (dp_rank + 1) * cp))
        assert dp_group == dims.dp_group_ranks(cp_rank) and len(set(dp_group) & set(cp_group)) == 1
        if ep > 1:
            # an EP group lies inside this rank's CP group, ep consecutive ranks
            [ep_group] = [g for g in groups["ep"] if rank in g]
            assert set(ep_group) <= set(cp_group) and ep_group == list(range(ep_group[0], ep_group[0] + ep))


@pytest.mark.parametrize("world, cp, ep, match", [
    (4, 3, 1, "cp=3 does not divide the world size 4; valid: \\[1, 2, 4\\]"),
    (4, 2, 4, "must divide cp=2"),
    (8, 2, 4, "ep=4 must divide cp=2"),
    (4, 0, 1, "cp=0 does not divide"),
    (0, 1, 1, "world size must be >= 1"),
])
def test_bad_topologies_are_rejected_once_with_the_valid_choices(world, cp, ep, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(world, cp=cp, ep=ep)


def test_one_process_has_no_groups_and_bad_ranks_are_rejected():
    assert ParallelDims(1).new_groups(0) == ProcessGroups(cp=None, dp=None, ep=None)
    with pytest.raises(ValueError, match="rank 4 outside world size 4"):
        ParallelDims(4, cp=2).new_groups(4)


LAYOUTS = [(2, 2), (2, 1), (4, 2), (1, 1)]


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {}
        for cp, ep in LAYOUTS:
            groups = ParallelDims(world, cp=cp, ep=ep).new_groups(rank)
            got = {}
            for axis in ("cp", "dp", "ep"):
                group = getattr(groups, axis)
                if group is None:
                    got[axis] = None
                    continue
                # a sum over the group of 2**rank names exactly the ranks in it
                mask = torch.tensor([2**rank], dtype=torch.int64)
                dist.all_reduce(mask, group=group)
                got[axis] = (sorted(dist.get_process_group_ranks(group)), int(mask))
            out[(cp, ep)] = got
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_new_groups_on_gloo_ranks_hold_exactly_their_ranks(tmp_path):
    world = 4
    run_ranks(_worker, world, str(tmp_path))
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for cp, ep in LAYOUTS:
            want = ParallelDims(world, cp=cp, ep=ep).group_ranks()
            for axis in ("cp", "dp", "ep"):
                if axis == "ep" and ep == 1:
                    assert got[(cp, ep)]["ep"] is None
                    continue
                [ranks] = [g for g in want[axis] if rank in g]
                assert got[(cp, ep)][axis] == (ranks, sum(2**r for r in ranks)), (cp, ep, axis)
