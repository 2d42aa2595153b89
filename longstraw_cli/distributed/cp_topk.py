"""The DSA top-k selection, and the same selection made GLOBAL when the keys are split across CP ranks.

DSA's lightning indexer scores every (query, key) pair and each query attends only to its k best keys. Under
context parallel rank r holds the contiguous key shard [start_r, end_r) (`shard_bounds`; sizes may differ, even
be 0) and scores the replicated queries against it; the selection must be the one over ALL keys, not per shard.

The selection rule is a strict total order on keys: score descending, then position ascending (ties go to the
lower position; -inf marks a masked key and ranks last, masked keys by position too). Under a total order the
global top-k is exact to merge: a key among the k best of all keys is among the k best of its own shard (the
order restricted to the shard is the same order). So each rank sends its local top-k (score, global position),
one all-gather collects every rank's candidates, and every rank applies the same rule to the candidates: the
result equals the single-device selection exactly (integer equality), ties across shards included.

Contract (the one selection rule, `longstraw_kernels.dsa.topk_lowest_position`, serves the model and the
merge): `k >= 0`; the result has min(k, number of keys) columns, the selected positions ascending: fewer than
k finite scores leave the rest to masked (-inf) keys, lowest positions first, as a stable descending sort
would; k above the number of keys returns every key. Scores must not be NaN. -0.0 and +0.0 are equal scores
(a tie), as they compare.

Simplifications: one all-gather of W * T * k candidates (8 bytes each for fp32/bf16 scores, 16 for fp64):
4096 queries at k = 2048 over 8 ranks gather 512 MiB, so callers block the queries. The selection syncs with
the host once (`nonzero`), the merge once more (the key count).

Legend: T queries (replicated), S keys of this rank's shard (P in the selection helpers), k selected per query,
W ranks in the group, X = W * k gathered candidates per query, J of this shard's keys selected by a query at most.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longstraw_cli.distributed.comm import rank_world
from longstraw_kernels import compute_dtype
from longstraw_kernels.dsa import topk_lowest_position

__all__ = ["cp_global_topk", "local_selection", "local_selection_mask"]

# the integer type of the same width, to move (score bits, position) pairs in one integer tensor
_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64}



def _check(scores_TS, k):
    if scores_TS.dim() != 2:
        raise ValueError(f"scores must be [T, S] (queries x keys), got shape {tuple(scores_TS.shape)}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")


def cp_global_topk(scores_local_TS: torch.Tensor, k: int, *, start: int, group=None) -> torch.Tensor:
    """-> idx_Tk of GLOBAL key positions (ascending), identical on every rank: `topk_lowest_position` of the
    scores of all shards concatenated in rank order (min(k, total keys) columns).

    `scores_local_TS`: the replicated queries against this rank's keys [start, start + S). Collective: every
    rank of the group calls it with the same T, k and score dtype; S and start are the rank's own (S may be 0).
    """
    _check(scores_local_TS, k)
    T, S = scores_local_TS.shape
    dtype = compute_dtype(scores_local_TS)
    if dtype not in _SAME_WIDTH_INT:
        raise ValueError(f"scores must be floating point, got {scores_local_TS.dtype}")
    int_dtype = _SAME_WIDTH_INT[dtype]
    # padding of a rank with fewer than k keys: score -inf at a position after every key, so it loses even to
    # masked keys; a position that large also bounds the positions that fit
    pad_position = torch.iinfo(int_dtype).max
    if start < 0 or start + S >= pad_position:
        raise ValueError(f"shard [{start}, {start + S}) outside [0, {pad_position}) for {dtype} scores")
    rank, world = rank_world(group)
    device = scores_local_TS.device

    local_Tn = topk_lowest_position(scores_local_TS, k)
    n = local_Tn.shape[1]
    # one integer tensor: per query k score bit patterns then k positions; the key count S at the very end
    packed_T2k = torch.empty((T, 2, k), dtype=int_dtype, device=device)
    packed_T2k[:, 0] = torch.tensor(float("-inf"), dtype=dtype).view(int_dtype).item()
    packed_T2k[:, 1] = pad_position
    packed_T2k[:, 0, :n] = scores_local_TS.gather(1, local_Tn).to(dtype).view(int_dtype)
    packed_T2k[:, 1, :n] = local_Tn + start
    packed = torch.cat([packed_T2k.reshape(-1), torch.tensor([S], dtype=int_dtype, device=device)])
    if world > 1:
        gathered_list = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(gathered_list, packed, group=group)
        gathered_WZ = torch.stack(gathered_list)
    else:
        gathered_WZ = packed[None]
    num_keys = int(gathered_WZ[:, -1].sum())

    cand_TW2k = gathered_WZ[:, :-1].view(world, T, 2, k).transpose(0, 1)
    score_TX = cand_TW2k[:, :, 0].reshape(T, world * k).view(dtype)
    position_TX = cand_TW2k[:, :, 1].reshape(T, world * k)
    # Candidates in position order (padding last), so the lower candidate index is the lower position: the same
    # rule then selects among them.
    by_position_TX = position_TX.argsort(dim=1, stable=True)
    best_Tk = topk_lowest_position(score_TX.gather(1, by_position_TX), min(k, num_keys))
    return position_TX.gather(1, by_position_TX.gather(1, best_Tk)).long()


def _local_sorted(idx_Tk, start, end):
    """This shard's selected local positions per row, ascending, then end - start for every other entry."""
    if idx_Tk.dim() != 2 or not 0 <= start <= end:
        raise ValueError(f"need idx [T, k] and 0 <= start <= end, got {tuple(idx_Tk.shape)}, [{start}, {end})")
    valid_Tk = (idx_Tk >= start) & (idx_Tk < end)
    return torch.where(valid_Tk, idx_Tk - start, end - start).sort(dim=1).values, valid_Tk


def local_selection(idx_Tk: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of this rank's keys [start, end) a global selection picked: -> (local_TJ int64, valid_TJ bool).

    Row t lists its selected keys of this shard first, as local positions (global - start) ascending; the rest
    of the row is padding (position 0, valid False). J = the most any row selects here (0 when none, so an empty
    shard gathers nothing). Each rank attends its query rows to its own pages `local` (masking `valid`) and the
    partials merge across ranks by LSE; a row with no valid entry is an empty partial (out 0, lse -inf).
    """
    sorted_Tk, valid_Tk = _local_sorted(idx_Tk, start, end)
    J = int(valid_Tk.sum(1).max()) if valid_Tk.numel() else 0
    valid_TJ = sorted_Tk[:, :J] < end - start
    return torch.where(valid_TJ, sorted_Tk[:, :J], 0), valid_TJ


def local_selection_mask(idx_Tk: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """-> mask_TP (bool, P = end - start): True where query t selected this rank's key start + p. Dense: for
    HF-style masked attention on short inputs (T x P bytes)."""
    sorted_Tk, _ = _local_sorted(idx_Tk, start, end)
    # other shards' entries land in one extra column, dropped
    mask_TQ = torch.zeros((idx_Tk.shape[0], end - start + 1), dtype=torch.bool, device=idx_Tk.device)
    return mask_TQ.scatter_(1, sorted_Tk, True)[:, :-1]
