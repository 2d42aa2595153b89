"""Context-parallel attention on 2 and 4 gloo ranks (CPU) against one rank, in float64.

Every rank builds the same seeded global problem and takes its shard; the parent computes the single-rank
result and compares each rank's outputs and gradients with it. One spawn per world size runs all its cases.
"""

import os

import pytest
import torch
import torch.distributed as dist

from conftest import cached_rank_results, join_gloo, rel_err
from longstraw_cli.distributed.cp_attention import cp_capture_attention, cp_replay_attention
from longstraw_kernels.attention import replay_attention

# world size -> name -> (pages per rank, R, S, B, Q, K, D, block_size); block sizes split shards unevenly.
# Fewer shards than ranks: CP groups of consecutive ranks (cp-fastest, as in ParallelDims) inside the world.
REPLAY_CASES = {
    2: {
        "even": ((20, 20), 7, 7, 2, 4, 2, 16, 8),
        "uneven_decode": ((3, 34), 1, 9, 2, 4, 2, 16, 8),
        "rank_without_pages": ((0, 37), 5, 12, 1, 2, 2, 16, 64),
        "no_pages_at_all": ((0, 0), 5, 5, 2, 4, 2, 16, 8),
    },
    4: {
        "37_pages": ((10, 9, 9, 9), 7, 7, 2, 4, 2, 16, 4),
        "ranks_without_pages": ((12, 0, 25, 0), 6, 11, 2, 4, 2, 16, 8),
        "decode": ((1, 2, 30, 4), 1, 17, 2, 4, 2, 16, 8),
        "mha": ((5, 17, 0, 15), 9, 9, 2, 2, 2, 16, 5),
        "cp2_groups": ((7, 20), 4, 6, 2, 4, 2, 16, 8),
    },
}
# world size -> name -> (tokens per rank, Q, K, D, block_size)
CAPTURE_CASES = {
    2: {"uneven": ((5, 40), 4, 2, 16, 16)},
    4: {
        "uneven": ((17, 5, 40, 23), 4, 2, 16, 8),
        "empty_shard": ((12, 0, 31, 7), 4, 2, 16, 7),
        "one_block": ((9, 33, 6, 20), 2, 2, 16, 1024),
        "cp2_groups": ((13, 30), 4, 2, 16, 8),
    },
}
NEW_NAMES = ("q_BRQD", "k_new_BSKD", "v_new_BSKD")
PAGE_NAMES = ("k_pages_PKD", "v_pages_PKD")
TOL = 1e-10


def _generator(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)


def replay_problem(pages_N, R, S, B, Q, K, D, seed):
    """The global problem: inputs over all pages (rank order) and the output's cotangent."""
    randn = _generator(seed)
    P = sum(pages_N)
    inputs = dict(q_BRQD=randn(B, R, Q, D), k_pages_PKD=randn(P, K, D), v_pages_PKD=randn(P, K, D),
                  k_new_BSKD=randn(B, S, K, D), v_new_BSKD=randn(B, S, K, D))
    return inputs, randn(B, R, Q, D)


def capture_problem(tokens_N, Q, K, D, seed):
    randn = _generator(seed)
    T = sum(tokens_N)
    return randn(1, T, Q, D), randn(T, K, D), randn(T, K, D)


def run_replay(attention, inputs, dout, **kwargs):
    """-> {"out": ..., name: grad} after backpropagating <out, dout>."""
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    out = attention(**leaves, **kwargs)
    (out * dout).sum().backward()
    return {"out": out.detach(), **{n: leaves[n].grad for n in leaves}}


def _replay_shard(cp_rank, group, pages_N, R, S, B, Q, K, D, block_size, seed):
    inputs, dout = replay_problem(pages_N, R, S, B, Q, K, D, seed)
    p0 = sum(pages_N[:cp_rank])
    for n in PAGE_NAMES:
        inputs[n] = inputs[n][p0 : p0 + pages_N[cp_rank]]
    kwargs = dict(scale=D**-0.5, group=group, block_size=block_size)
    result = run_replay(cp_replay_attention, inputs, dout, **kwargs)
    # Scoring runs the same forward without autograd.
    with torch.no_grad():
        result["out_no_grad"] = cp_replay_attention(**inputs, **kwargs)
    return result


def _capture_shard(cp_rank, group, tokens_N, Q, K, D, block_size, seed):
    q_BTQD, k_TKD, v_TKD = capture_problem(tokens_N, Q, K, D, seed)
    t0, t1 = sum(tokens_N[:cp_rank]), sum(tokens_N[: cp_rank + 1])
    return cp_capture_attention(q_BTQD[:, t0:t1], k_TKD[t0:t1], v_TKD[t0:t1], scale=D**-0.5, group=group,
                                block_size=block_size)


def _worker(rank, world_size, port, out_dir):
    groups = join_gloo(rank, world_size, port)
    results = {}
    for table, kind, shard in ((REPLAY_CASES, "replay", _replay_shard), (CAPTURE_CASES, "capture", _capture_shard)):
        for seed, (name, case) in enumerate(table[world_size].items()):
            cp = len(case[0])
            results[kind, name] = shard(rank % cp, groups.get(cp), *case, seed)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    """world size -> [rank -> {(kind, name): result}], spawning each world size once."""
    return cached_rank_results(tmp_path_factory, _worker, "cp")


def _cases(table):
    return [(w, name) for w, cases in table.items() for name in cases]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,name", _cases(REPLAY_CASES))
def test_replay_matches_one_rank(cp_results, world_size, name):
    pages_N, R, S, B, Q, K, D, block_size = case = REPLAY_CASES[world_size][name]
    seed = list(REPLAY_CASES[world_size]).index(name)
    inputs, dout = replay_problem(*case[:-1], seed)
    ref = run_replay(replay_attention, inputs, dout, scale=D**-0.5, block_size=block_size)

    for rank, results in enumerate(cp_results(world_size)):
        got, cp_rank = results["replay", name], rank % len(pages_N)
        assert rel_err(got["out"], ref["out"]) <= TOL, rank
        assert torch.equal(got["out_no_grad"], got["out"]), rank
        # The loss is replicated, so every rank must hold the full single-rank gradients.
        for n in NEW_NAMES:
            assert rel_err(got[n], ref[n]) <= TOL, (rank, n)
        # Page gradients are per shard: each rank's slice of the single-rank page gradient.
        p0 = sum(pages_N[:cp_rank])
        for n in PAGE_NAMES if pages_N[cp_rank] else ():
            assert rel_err(got[n], ref[n][p0 : p0 + pages_N[cp_rank]]) <= TOL, (rank, n)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,name", _cases(CAPTURE_CASES))
def test_capture_matches_one_rank(cp_results, world_size, name):
    tokens_N, Q, K, D, block_size = case = CAPTURE_CASES[world_size][name]
    seed = list(CAPTURE_CASES[world_size]).index(name)
    q_BTQD, k_TKD, v_TKD = capture_problem(*case[:-1], seed)
    no_pages_PKD = k_TKD[:0]
    ref_BTQD = replay_attention(q_BTQD, no_pages_PKD, no_pages_PKD, k_TKD[None], v_TKD[None], scale=D**-0.5)

    for rank, results in enumerate(cp_results(world_size)):
        cp_rank = rank % len(tokens_N)
        t0, t1 = sum(tokens_N[:cp_rank]), sum(tokens_N[: cp_rank + 1])
        got_BTQD = results["capture", name]
        if t1 == t0:
            assert got_BTQD.shape == (1, 0, Q, D)
            continue
        assert rel_err(got_BTQD, ref_BTQD[:, t0:t1]) <= TOL, rank
