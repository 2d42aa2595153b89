"""The DSA selection rule (topk.py) for capture's many long rows: a threshold that keeps every key of the top-k, the
keys at or above it gathered by one pass, and the rule run on those few.

Cut a row of S scores into m >= k chunks and take each chunk's largest score. The k-th largest of those maxima, v,
has at least k keys at or above it (each of the k chunks whose maximum is >= v holds one), so the k-th best score of
the row is >= v, and every key the rule selects scores >= v. One Triton pass (`_gather_kernel`) appends each row's
keys >= v (position and score) to that row's candidate list, at most CAP of them; the rule then runs on the
candidates sorted by position (`topk._rule_rows`), so ties still go to the lower position, and maps them back.
Exact, whatever the scores: a row with more than CAP keys >= v (scores that rise with position put whole chunks
above v) takes the rule over its whole row instead (`topk.topk_lowest_position` does that).

For uniform random scores about 1% of a row are candidates (S = 262,144, k = 2,049, chunks of 16: v is near the
0.75 quantile of the chunk maxima, 16 keys each). The rule on the full rows is torch.topk of k + 1 over 2^27 scores,
2.8 ms on an H200 (docs/BENCHMARKS.md); here one reduction and one gathering pass read the scores, and the top-k's
and the sort run over 16x fewer values.

Legend: R rows, S keys per row, k selected, m chunks, CAP candidates a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MIN_KEYS", "candidate_positions", "serves"]

# keys a program reads in the gathering pass
BLOCK = 4096
# the least keys a chunk maximum covers (fewer: the maxima are nearly the row) and the candidates a row holds, in k
MIN_CHUNK = 4
CAP_PER_K = 4
# below this many keys a row the rule's torch.topk is as cheap
MIN_KEYS = 16384


def serves(scores_RS: torch.Tensor, k: int) -> bool:
    """fp32 rows of at least MIN_KEYS keys, with room for k chunks of MIN_CHUNK keys and CAP candidates below S."""
    S = scores_RS.shape[-1]
    return scores_RS.dtype == torch.float32 and S >= MIN_KEYS and 0 < k and S // (2 * k) >= MIN_CHUNK


def chunk_keys(S: int, k: int) -> int:
    """Keys a chunk: the largest power of two, at most 16, that leaves at least 2k chunks."""
    return min(16, 1 << ((S // (2 * k)).bit_length() - 1))


@triton.jit
def _gather_kernel(s_ptr, v_ptr, count_ptr, pos_ptr, val_ptr, S, CAP, stride_r, BLOCK: tl.constexpr):
    # a program appends its block's keys >= the row's threshold at the row's running count (an atomic add); the
    # order among programs is any: the caller sorts the candidates by position
    pid, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < S
    x = tl.load(s_ptr + row * stride_r + offs, mask=ok, other=float("-inf"))
    keep = ok & (x >= tl.load(v_ptr + row))
    n = tl.sum(keep.to(tl.int32), axis=0)
    if n > 0:
        base = tl.atomic_add(count_ptr + row, n)
        slot = base + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        put = keep & (slot < CAP)
        tl.store(pos_ptr + row * CAP + slot, offs, mask=put)
        tl.store(val_ptr + row * CAP + slot, x, mask=put)


def candidate_positions(scores_RS: torch.Tensor, k: int, rule_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (positions [R, k] int64 by the rule, ascending, for the rows whose candidates fit; the rows whose did not,
    [n] int64 indices: the caller runs the rule on those). `rule_rows(rows_RS, k)` is the rule on few keys a row."""
    R, S = scores_RS.shape
    chunk = chunk_keys(S, k)
    m = S // chunk
    # the first m chunks as a view (a reshape of the sliced rows would copy them when S is not a multiple)
    maxima_Rm = scores_RS.as_strided((R, m, chunk), (scores_RS.stride(0), chunk, 1)).amax(-1)
    v_R = maxima_Rm.topk(k, dim=-1, sorted=False).values.amin(-1).contiguous()
    cap = CAP_PER_K * k
    count_R = torch.zeros(R, dtype=torch.int32, device=scores_RS.device)
    pos_RC = torch.full((R, cap), 2**31 - 1, dtype=torch.int32, device=scores_RS.device)
    val_RC = torch.full((R, cap), float("-inf"), dtype=torch.float32, device=scores_RS.device)
    _gather_kernel[(triton.cdiv(S, BLOCK), R)](scores_RS, v_R, count_R, pos_RC, val_RC, S, cap, scores_RS.stride(0),
                                                BLOCK=BLOCK, num_warps=8)
    # candidates by position: the rule's lower index is then the lower position (padding, -inf, sorts last)
    pos_RC, order_RC = pos_RC.sort(dim=-1)
    chosen_Rk = rule_rows(val_RC.gather(-1, order_RC), k)
    positions_Rk = pos_RC.gather(-1, chosen_Rk).long()
    return positions_Rk, (count_R > cap).nonzero()[:, 0]
