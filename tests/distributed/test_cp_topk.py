"""The DSA top-k selection, single device against a stable sort and a brute force, then made global across 2 and
4 gloo ranks (CPU): every rank's selection must equal the one-rank selection over all keys as integers, on
random and tie-heavy scores (ReLU zeros, -0.0 against +0.0, few distinct values, bf16), masked keys, shards
smaller than k or empty, k above the number of keys, no queries, k = 0.

Then the use it is made for: each rank attends (MLA-like: one latent key/value per position for all heads, value
dim != key dim) to its own selected keys, and cp_attention's `MergeAcrossRanks` merges the partials by LSE; the
output and the gradients (q all-reduced by `AllReduceGrad`, keys/values per shard) equal one rank's sparse
attention over the global selection.
"""

import os

import pytest
import torch
import torch.distributed as dist

from conftest import cached_rank_results, join_gloo, rel_err
from longstraw_cli.distributed.cp import shard_bounds
from longstraw_cli.distributed.cp_attention import AllReduceGrad, MergeAcrossRanks
from longstraw_cli.distributed.cp_topk import cp_global_topk, local_selection, local_selection_mask
from longstraw_kernels.dsa import topk_lowest_position

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
# world size -> name -> (keys per rank, T queries, k, kind of scores, dtype). Fewer shards than ranks: CP groups
# of consecutive ranks inside the world.
CASES = {
    2: {
        "random": ((37, 20), 9, 16, "random", F32),
        "ties": ((25, 25), 12, 10, "ties", F32),
        "k_above_a_shard": ((3, 40), 7, 8, "ties_masked", F32),
        "k_above_all_keys": ((5, 4), 6, 20, "ties_masked", F32),
        # masked keys of rank 1 must beat rank 0's padding
        "mostly_masked": ((3, 12), 10, 8, "mostly_masked", F32),
        "empty_shard": ((0, 30), 5, 7, "ties", F32),
        "no_queries": ((10, 10), 0, 4, "ties", F32),
        "k0": ((5, 6), 3, 0, "ties", F32),
        "bf16": ((33, 31), 8, 12, "ties_masked", BF16),
        "fp64": ((19, 24), 8, 12, "few_values", F64),
    },
    4: {
        "shard_bounds": (tuple(b - a for a, b in (shard_bounds(101, 4, r) for r in range(4))), 10, 24,
                         "ties_masked", F32),
        "uneven": ((17, 0, 40, 3), 9, 20, "ties_masked", F32),
        "k_above_all_keys": ((2, 0, 3, 1), 4, 9, "ties_masked", F32),
        "mostly_masked": ((2, 5, 0, 9), 10, 8, "mostly_masked", F32),
        "causal": ((12, 9, 0, 14), 11, 10, "causal", F32),
        "random": ((30, 30, 30, 30), 16, 32, "random", F32),
        "few_values": ((8, 8, 8, 8), 6, 13, "few_values", BF16),
        "no_keys": ((0, 0, 0, 0), 3, 5, "ties", F32),
        "cp2_groups": ((20, 13), 7, 15, "ties_masked", F32),
    },
}
# world size -> (keys per rank, T, k, kind of indexer scores) for sparse attention over the global selection;
# "causal" and "mostly_masked" leave rows with no selected key on some rank (an empty partial: out 0, lse -inf).
ATTN_CASES = {2: ((14, 9), 10, 6, "mostly_masked"), 4: ((12, 0, 25, 7), 15, 9, "causal")}
H, D, V = 3, 8, 5


def make_scores(T, S, kind, dtype, seed):
    """[T, S] scores of a kind: "random" (no ties); "ties": relu(round(2 randn)) times a random sign, small
    integers and about half exact zeros, half of those -0.0 (a negative weight times a ReLU zero, as the indexer's
    sum produces); "few_values": 3 values; "ties_masked": ties with a third of the keys -inf, "mostly_masked": 80 %;
    "causal": ties with query t seeing keys <= 3 t only, so early rows hold fewer than k finite scores."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(T, S, generator=g, dtype=F64).to(dtype)
    if kind == "few_values":
        return torch.randint(0, 3, (T, S), generator=g).to(dtype)
    relu_TS = torch.randn(T, S, generator=g, dtype=F64).mul(2).round().clamp_min(0)
    sign_TS = torch.where(torch.rand(T, S, generator=g) < 0.5, -1.0, 1.0).to(F64)
    scores_TS = (relu_TS * sign_TS).to(dtype)
    if kind in ("ties_masked", "mostly_masked"):
        scores_TS[torch.rand(T, S, generator=g) < (1 / 3 if kind == "ties_masked" else 0.8)] = float("-inf")
    if kind == "causal":
        scores_TS[torch.arange(S)[None, :] > 3 * torch.arange(T)[:, None]] = float("-inf")
    return scores_TS


def brute_force(scores_TS, k):
    """The definition: order keys by (score desc, position asc) in Python, take the first k, ascending."""
    T, S = scores_TS.shape
    rows = [sorted(sorted(range(S), key=lambda s: (-float(scores_TS[t, s]), s))[:k]) for t in range(T)]
    return torch.tensor(rows, dtype=torch.long).reshape(T, min(k, S))


# -- single process -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["random", "ties", "ties_masked", "mostly_masked", "few_values", "causal"])
@pytest.mark.parametrize("dtype", [F32, BF16, F64])
def test_selection_is_the_stable_sort(kind, dtype):
    for seed, (T, S, k) in enumerate([(7, 63, 10), (5, 20, 20), (4, 9, 15), (3, 1000, 64), (0, 8, 3), (6, 0, 2),
                                      (5, 11, 0), (9, 30, 1)]):
        scores_TS = make_scores(T, S, kind, dtype, seed)
        idx_Tk = topk_lowest_position(scores_TS, k)
        expected_Tk = scores_TS.sort(dim=1, descending=True, stable=True).indices[:, :k].sort(dim=1).values
        assert idx_Tk.dtype == torch.long and torch.equal(idx_Tk, expected_Tk), (T, S, k)
        if S <= 63:
            assert torch.equal(idx_Tk, brute_force(scores_TS, k)), (T, S, k)


def test_rows_with_and_without_a_tie_at_the_kth_place_in_one_call():
    """[B, T, S]: continuous rows (one top-k decides them) beside rows tied across the k-th place (the tie rule's
    scans), and a row of every key but fewer than k finite: each row its own stable sort's set."""
    g = torch.Generator().manual_seed(3)
    scores_BTS = torch.randn(2, 6, 50, generator=g)
    scores_BTS[0, 1] = make_scores(1, 50, "ties", F32, 4)[0]
    scores_BTS[1, 3] = make_scores(1, 50, "few_values", F32, 5)[0]
    scores_BTS[1, 4, 5:] = float("-inf")
    for k in (1, 7, 49, 50, 60):
        idx_BTk = topk_lowest_position(scores_BTS, k)
        expected = scores_BTS.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
        assert torch.equal(idx_BTk, expected), k


def test_zero_signs_tie_and_masked_fill_by_position():
    scores_TS = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0, float("-inf"), float("-inf")],
                              [float("-inf"), 2.0, float("-inf"), float("-inf"), 2.0, -1.0, float("-inf")]])
    assert topk_lowest_position(scores_TS, 5).tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 4, 5]]


def test_errors():
    with pytest.raises(ValueError, match="k must be an integer >= 0, got -1"):
        topk_lowest_position(torch.zeros(2, 3), -1)
    with pytest.raises(ValueError, match=r"scores must be \[T, S\]"):
        cp_global_topk(torch.zeros(3), 2, start=0)
    with pytest.raises(ValueError, match="start <= end"):
        local_selection(torch.zeros(2, 3, dtype=torch.long), 5, 4)


def test_local_selection_lists_the_shards_keys():
    idx_Tk = torch.tensor([[7, 2, 9, 3], [0, 1, 2, 8], [4, 5, 6, 7]])
    local_TJ, valid_TJ = local_selection(idx_Tk, 2, 5)
    assert local_TJ.tolist() == [[0, 1], [0, 0], [2, 0]]
    assert valid_TJ.tolist() == [[True, True], [True, False], [True, False]]
    assert local_selection_mask(idx_Tk, 2, 5).tolist() == [[True, True, False], [True, False, False],
                                                           [False, False, True]]
    local_TJ, valid_TJ = local_selection(idx_Tk, 10, 10)
    assert local_TJ.shape == valid_TJ.shape == (3, 0)
    assert local_selection_mask(idx_Tk, 10, 10).shape == (3, 0)


def sparse_partial(q_THD, k_SD, v_SV, local_TJ, valid_TJ):
    """(out_THV, lse_TH) of each query over the keys local_TJ[t][valid_TJ[t]]. A row with no such key is the
    empty partial (0, -inf), built so that its backward has no NaN: logsumexp of an all -inf row back-propagates
    0 * exp(-inf - (-inf)) = NaN even under a zero gradient, so such rows get a finite dummy lse until the end."""
    s_THJ = torch.einsum("thd,tjd->thj", q_THD, k_SD[local_TJ]) * D**-0.5
    s_THJ = s_THJ.masked_fill(~valid_TJ[:, None, :], float("-inf"))
    any_T11 = valid_TJ.any(1)[:, None, None]
    lse_TH = torch.logsumexp(torch.where(any_T11, s_THJ, 0.0), dim=-1)
    out_THV = torch.einsum("thj,tjv->thv", torch.exp(s_THJ - lse_TH[..., None]), v_SV[local_TJ])
    return out_THV, torch.where(any_T11[..., 0], lse_TH, float("-inf"))


def attention_problem(keys_W, T, k, kind, seed):
    g = torch.Generator().manual_seed(seed)
    S = sum(keys_W)
    leaves = dict(q_THD=torch.randn(T, H, D, generator=g, dtype=F64), k_SD=torch.randn(S, D, generator=g, dtype=F64),
                  v_SV=torch.randn(S, V, generator=g, dtype=F64))
    return make_scores(T, S, kind, F64, seed), leaves, torch.randn(T, H, V, generator=g, dtype=F64)


def one_rank_attention(keys_W, T, k, kind, seed):
    scores_TS, leaves, dout_THV = attention_problem(keys_W, T, k, kind, seed)
    leaves = {n: t.requires_grad_() for n, t in leaves.items()}
    idx_Tk = topk_lowest_position(scores_TS, k)
    out_THV, _ = sparse_partial(*leaves.values(), idx_Tk, torch.ones_like(idx_Tk, dtype=torch.bool))
    (out_THV * dout_THV).sum().backward()
    return {"out": out_THV.detach(), **{n: t.grad for n, t in leaves.items()}}


def _attention_shard(cp_rank, group, keys_W, T, k, kind, seed):
    scores_TS, leaves, dout_THV = attention_problem(keys_W, T, k, kind, seed)
    start, end = sum(keys_W[:cp_rank]), sum(keys_W[: cp_rank + 1])
    q_THD = leaves["q_THD"].requires_grad_()
    k_PD, v_PV = (leaves[n][start:end].requires_grad_() for n in ("k_SD", "v_SV"))
    idx_Tk = cp_global_topk(scores_TS[:, start:end], k, start=start, group=group)
    # every rank's keys add to dq: summed in the backward, as cp_replay_attention does
    q_pages_THD = AllReduceGrad.apply(q_THD, group)
    out_r_THV, lse_r_TH = sparse_partial(q_pages_THD, k_PD, v_PV, *local_selection(idx_Tk, start, end))
    # [T, H, V] is the merge's [B, R, Q, D] with B = 1; lse [B, Q, R] = [1, H, T]
    out_BTHV, _ = MergeAcrossRanks.apply(out_r_THV[None], lse_r_TH.T[None], group)
    (out_BTHV[0] * dout_THV).sum().backward()
    return {"out": out_BTHV[0].detach(), "q_THD": q_THD.grad, "k_SD": k_PD.grad, "v_SV": v_PV.grad}


# -- 2 and 4 ranks --------------------------------------------------------------------------------------------

def _shard_case(cp_rank, group, keys_W, T, k, kind, dtype, seed):
    scores_TS = make_scores(T, sum(keys_W), kind, dtype, seed)
    start, end = sum(keys_W[:cp_rank]), sum(keys_W[: cp_rank + 1])
    idx_Tk = cp_global_topk(scores_TS[:, start:end], k, start=start, group=group)
    return {"idx": idx_Tk, "local": local_selection(idx_Tk, start, end),
            "mask": local_selection_mask(idx_Tk, start, end)}


def _worker(rank, world_size, port, out_dir):
    groups = join_gloo(rank, world_size, port)
    results = {}
    for seed, (name, case) in enumerate(CASES[world_size].items()):
        cp = len(case[0])
        results[name] = _shard_case(rank % cp, groups.get(cp), *case, seed)
    keys_W = ATTN_CASES[world_size][0]
    results["attention"] = _attention_shard(rank % len(keys_W), groups.get(len(keys_W)), *ATTN_CASES[world_size],
                                            seed=0)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    """world size -> [rank -> {name: result}], starting each world size once."""
    return cached_rank_results(tmp_path_factory, _worker, "topk")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,name", [(w, n) for w, cases in CASES.items() for n in cases])
def test_global_topk_matches_one_rank(cp_results, world_size, name):
    keys_W, T, k, kind, dtype = CASES[world_size][name]
    seed = list(CASES[world_size]).index(name)
    scores_TS = make_scores(T, sum(keys_W), kind, dtype, seed)
    ref_Tk = topk_lowest_position(scores_TS, k)
    assert ref_Tk.shape == (T, min(k, sum(keys_W)))
    selected_T = torch.zeros(T, dtype=torch.long)
    for rank, results in enumerate(cp_results(world_size)):
        got, cp_rank = results[name], rank % len(keys_W)
        assert got["idx"].dtype == torch.long and torch.equal(got["idx"], ref_Tk), rank
        start, end = sum(keys_W[:cp_rank]), sum(keys_W[: cp_rank + 1])
        mask_TS = torch.zeros(T, sum(keys_W), dtype=torch.bool).scatter_(1, ref_Tk, True)
        assert torch.equal(got["mask"], mask_TS[:, start:end]), rank
        # local_selection: each row's selected keys of this shard first, ascending, then padding (0, invalid)
        local_TJ, valid_TJ = got["local"]
        for mask_P, local_J, valid_J in zip(got["mask"], local_TJ, valid_TJ):
            num_valid = int(valid_J.sum())
            assert local_J[valid_J].tolist() == mask_P.nonzero().squeeze(1).tolist(), rank
            assert valid_J[:num_valid].all() and not local_J[num_valid:].any(), rank
        if rank < len(keys_W):
            selected_T += valid_TJ.sum(1)
    # the shards' selections partition the global one
    assert torch.equal(selected_T, torch.full((T,), ref_Tk.shape[1])), selected_T


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", list(ATTN_CASES))
def test_sparse_attention_merged_across_ranks(cp_results, world_size):
    keys_W = ATTN_CASES[world_size][0]
    ref = one_rank_attention(*ATTN_CASES[world_size], seed=0)
    for rank, results in enumerate(cp_results(world_size)):
        got, cp_rank = results["attention"], rank % len(keys_W)
        assert rel_err(got["out"], ref["out"]) <= 1e-12, rank
        assert rel_err(got["q_THD"], ref["q_THD"]) <= 1e-12, rank
        start, end = sum(keys_W[:cp_rank]), sum(keys_W[: cp_rank + 1])
        for n in ("k_SD", "v_SV") if end > start else ():
            assert rel_err(got[n], ref[n][start:end]) <= 1e-12, (rank, n)
