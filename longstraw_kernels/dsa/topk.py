"""The DSA top-k selection rule, one implementation for the model (one device), context parallel's merge and
decode (with a sync-free compaction).

A strict total order on keys: score descending, then position ascending (ties go to the LOWER position; -inf
marks a masked key and ranks last, masked keys by position too). Index scores are sums of ReLUs, so exact ties
(often at 0) occur; torch.topk leaves the choice among them unspecified, this rule makes the selection exactly
reproducible. Under a total order the global top-k of keys split into shards is exact to merge: a key among the
k best of all keys is among the k best of its own shard (`distributed/cp_topk.py`).

Legend: S keys (the last axis), k selected.
"""

from __future__ import annotations

import functools
import logging

import torch

from longstraw_kernels import kernel_choice, optional_module, say_once

log = logging.getLogger(__name__)

__all__ = ["prepare_topk", "topk_lowest_position", "topk_lowest_position_static"]


def _check(scores__S: torch.Tensor, k: int) -> int:
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    return min(k, scores__S.shape[-1])


def _chosen(scores__S: torch.Tensor, k: int) -> torch.Tensor:
    """[..., S] bool, exactly k True per row: the k'-th largest score v (a value, so ties do not matter) splits
    each row into keys above v (all taken, fewer than k) and keys equal to v, of which the lowest positions fill
    the rest. No full sort."""
    kth = scores__S.topk(k, dim=-1).values[..., -1:]
    above = scores__S > kth
    tie = scores__S == kth
    need = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    return above | (tie & (tie.cumsum(-1, dtype=torch.int32) <= need))


def tie_rule_positions(scores_RS: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k] positions, ascending, of rows [R, S] by the tie rule's scans alone (`_chosen`, compacted by
    nonzero(): a host synchronisation). Exactly k per row, so the row-major nonzero positions reshape to [R, k]."""
    return _chosen(scores_RS, k).nonzero()[:, -1].view(-1, k)


def topk_lowest_position(scores__S: torch.Tensor, k: int) -> torch.Tensor:
    """Positions [..., k'] (int64, ascending; k' = min(k, S)) of the k' best keys of each row along the last axis
    by (score desc, position asc): the set `scores.sort(-1, descending=True, stable=True).indices[..., :k']`
    holds. Scores must not be NaN; -0.0 and +0.0 are equal scores (a tie). CUDA fp32 rows of many keys (the
    capture's) take the threshold select (`triton_threshold.py`, kernels.dsa=auto), other rows one torch.topk
    (`_rule_rows`: one host synchronisation, which rows tie across the k-th place, their chosen masks compacted by
    nonzero()); the threshold select has none."""
    k = _check(scores__S, k)
    S = scores__S.shape[-1]
    if k == 0 or scores__S.numel() == 0:
        return torch.empty(scores__S.shape[:-1] + (k,), dtype=torch.long, device=scores__S.device)
    if k == S:
        return torch.arange(S, device=scores__S.device).expand(scores__S.shape).clone()
    rows_RS = scores__S.reshape(-1, S)
    module = _threshold_module(rows_RS, k)
    if module is None:
        return _rule_rows(rows_RS, k).view(scores__S.shape[:-1] + (k,))
    # the capture's long rows on CUDA: the rule over the keys at or above a bound from the chunk maxima, one Triton
    # program a row (triton_threshold.py; a row with more of those than it holds, over the whole row)
    return module.threshold_positions_triton(rows_RS, k)[0].view(scores__S.shape[:-1] + (k,))


def prepare_topk(longest: int, k: int, device: torch.device) -> int:
    """Before rows of up to `longest` keys on `device` (a capture): compile the threshold select for each size of
    its chunks and for rows of `longest` keys, in threads at once (`triton_threshold.precompile`), where it will
    serve them -> how many compiles."""
    module = _auto_threshold_module(torch.device(device).type == "cuda")
    if module is None:
        return 0
    try:
        return module.precompile(longest, k)
    except Exception as exc:  # a Triton whose warm-up differs: the select compiles at its first call instead
        say_once(f"DSA top-k: compiling the threshold select ahead failed ({type(exc).__name__}: {exc}); it "
                 "compiles at each chunk size's first call instead")
        return 0


def _auto_threshold_module(on_cuda: bool):
    """triton_threshold where `kernels.dsa=auto` would take it for rows on this device (CUDA, and it imports),
    else None."""
    if not on_cuda or kernel_choice("dsa") != "auto":
        return None
    return optional_module("longstraw_kernels.dsa.triton_threshold")


def _threshold_module(rows_RS: torch.Tensor, k: int):
    """triton_threshold where it serves these rows (CUDA fp32 long rows, kernels.dsa=auto), else None (said once
    where only k keeps the kernel from rows it would take)."""
    module = _auto_threshold_module(rows_RS.is_cuda)
    if module is None or module.serves(rows_RS, k):
        return module
    if module.serves(rows_RS, 1):
        _say_k_is_past_the_threshold_select(k, min(module.CAP, module.MAXIMA) // 2)
    return None


def _say_k_is_past_the_threshold_select(k: int, most: int) -> None:
    say_once(f"DSA top-k: k = {k} is past the threshold select's {most}; the capture's selection runs as the "
             "whole-row torch.topk rule (the same positions, ~2x slower on an H100)")


def _rule_rows(rows_RS: torch.Tensor, k: int) -> torch.Tensor:
    """`topk_lowest_position` of rows [R, S] (0 < k < S) by torch.topk."""
    # one top-k, of k + 1: where the (k+1)-th best score is below the k-th, the k best are one set whatever order
    # ties among them took (every key tied with the k-th is among them). Only the other rows (a tie across the
    # k-th place: masked -inf keys, when fewer than k are visible) need the tie rule's scans.
    values_RK, idx_RK = rows_RS.topk(k + 1, dim=-1)
    out_RK = idx_RK[:, :k].sort(dim=-1).values
    tied_R = values_RK[:, k] == values_RK[:, k - 1]
    tied = tied_R.nonzero()[:, 0]
    if tied.numel():
        out_RK[tied] = tie_rule_positions(rows_RS[tied], k)
    return out_RK


def topk_lowest_position_static(scores__S: torch.Tensor, k: int) -> torch.Tensor:
    """`topk_lowest_position`, the same positions, with no host synchronisation and no scan over the keys (a CUDA
    graph replays it in the decode step, a few rows against every key). On CUDA, scores of 32 bits or fewer: a
    radix select in Triton (`triton_topk.py`), behind one opaque op inside a compiled step; elsewhere (or without
    Triton, or kernels.dsa=torch) one top-k over int64 keys that order as the rule does (`_rule_keys`);
    wider scores (fp64, the CPU tests): two top-k's (`two_topk_positions`)."""
    k = _check(scores__S, k)
    S = scores__S.shape[-1]
    if k == 0 or scores__S.numel() == 0:
        return torch.empty(scores__S.shape[:-1] + (k,), dtype=torch.long, device=scores__S.device)
    if scores__S.dtype.itemsize > 4:
        return two_topk_positions(scores__S, k)
    if scores__S.is_cuda:
        return _static_topk_op(scores__S.reshape(-1, S), k).view(scores__S.shape[:-1] + (k,))
    return _packed_key_positions(scores__S, k)


def _packed_key_positions(scores__S: torch.Tensor, k: int) -> torch.Tensor:
    """The static rule by one top-k over `_rule_keys` (H200, 8 rows of 263K keys, compiled and graph-replayed: 0.165
    ms, against 0.206 for `two_topk_positions`; scripts/bench/bench_topk.py --decode); a key's low 32 bits give its
    position back."""
    S = scores__S.shape[-1]
    top = _rule_keys(scores__S).topk(k, dim=-1, sorted=False).values
    return (S - 1 - (top & 0xFFFFFFFF)).sort(dim=-1).values


# the decode step's selection on CUDA: the Triton radix select where it serves, else the packed keys; opaque to
# torch.compile (the page count stays a dynamic size across it, and inductor does not re-trace the kernels)
@torch.library.custom_op("longstraw::dsa_static_topk", mutates_args=())
def _static_topk_op(scores_RS: torch.Tensor, k: int) -> torch.Tensor:
    module = optional_module("longstraw_kernels.dsa.triton_topk") if kernel_choice("dsa") == "auto" else None
    if module is not None and module.supported(scores_RS):
        return module.topk_positions_triton(scores_RS, k)
    if module is not None:
        _say_the_packed_keys_run(str(scores_RS.dtype))
    return _packed_key_positions(scores_RS, k)


@functools.cache
def _say_the_packed_keys_run(dtype: str) -> None:
    log.warning("DSA top-k: %s scores are not what the radix-select kernel takes (fp32, bf16, fp16); the decode's "
                "selection runs as a torch.topk over packed keys, ~3x slower on an H200 (logged once)", dtype)


@_static_topk_op.register_fake
def _(scores_RS, k):
    return scores_RS.new_empty(scores_RS.shape[0], k, dtype=torch.long)


def two_topk_positions(scores__S: torch.Tensor, k: int) -> torch.Tensor:
    """`topk_lowest_position_static` for any score dtype (0 < k <= S): the top-k gives the keys strictly above the
    k-th value, a second top-k over the positions of the keys tied with it the ties that fill up to k."""
    S = scores__S.shape[-1]
    # unsorted: only the k-th value (the least of them) is needed, and the result is sorted by position below
    values, idx = scores__S.topk(k, dim=-1, sorted=False)
    kth = values.amin(-1, keepdim=True)
    above = values > kth
    need = k - above.sum(-1, keepdim=True)
    rank_S = torch.arange(S, 0, -1, dtype=torch.int32, device=scores__S.device)
    # key S - position for the tied keys, so the lowest positions come first
    ties = S - torch.where(scores__S == kth, rank_S, 0).topk(k, dim=-1).values.long()
    ties = ties.masked_fill(torch.arange(k, device=scores__S.device) >= need, S)
    # exactly k entries are below S: the keys above the k-th value and the first `need` ties
    return torch.cat([idx.masked_fill(~above, S), ties], dim=-1).sort(dim=-1).values[..., :k]


def _rule_keys(scores__S: torch.Tensor) -> torch.Tensor:
    """int64 keys [..., S] whose descending order is the rule's: the score's fp32 bits made order-preserving as a
    signed integer (negative floats' magnitude bits flipped; -0.0 made +0.0 first, a tie) in the high 32 bits,
    S - 1 - position in the low 32 (the lower position, the larger key)."""
    S = scores__S.shape[-1]
    bits = torch.where(scores__S == 0, 0.0, scores__S.float()).view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.long() << 32) | (S - 1 - torch.arange(S, device=scores__S.device))
