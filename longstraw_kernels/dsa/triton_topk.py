"""The DSA selection rule (topk.py) for a few rows of many keys, as a radix select in Triton: the decode step's
top-k (G responses' rows against a prompt's index keys), with no host synchronisation and no sort.

A key's score becomes a 32-bit integer that orders as the score (`_keys`: topk.py's `_rule_keys` without the
position); the k-th best of a row is found from its top bits down, BITS bits a level (four levels of 8). Each
level is one launch over the row in chunks of CHUNK keys: a program counts its chunk's keys (those that share the
digits chosen so far) per digit value and adds the counts into the row's histogram of that level; the next level's
programs read the finished histograms and walk down them (`_descend`) to the digit where the k-th best falls.
After the last level the k-th best key T is known, and how many keys equal to T the selection takes (`need`: the
lowest positions among them, the rule's ties). One more launch counts each chunk's keys above and equal to T, a
last one writes each chunk's selected positions at the row's running count: positions come out ascending, as the
rule's functions return them. Six launches, each reading the row's scores (8 rows of 263K fp32 scores: 8.4 MB,
from L2 after the first), and a memset of the histograms.

Measured on an H200 (8 rows of 263,168 fp32 keys, k = 2,048, compiled and graph-replayed; docs/BENCHMARKS.md):
0.070 ms (0.068 at 4 warps) against 0.204 for the packed-key torch.topk it replaced on CUDA. Triton's histogram
costs about bins / 32 x bits operations a key and lane: 11-bit digits (three levels) took 0.249 ms, 6-bit ones
(six levels) 0.078. At capture's sizes (2^27 scores a call, thousands of rows) it is slower than torch.topk
(3.4-3.5 against 2.8 ms): the capture takes the threshold select (`triton_threshold.py`).

Exact: the same positions as `topk_lowest_position` (tests/kernels/test_dsa_topk.py, Triton's interpreter on CPU
and the GPU): keys are integers, counts are integers, nothing is rounded.

Legend: R rows, S keys per row, k selected, C chunks of a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["CHUNK", "supported", "topk_positions_triton"]

# keys a program reads per launch: 64-65 programs a row of 263K keys, ~520 for 8 rows; with BITS and WARPS the
# fastest of nine configs on an H200 within 2% (8 bits, 4,096 keys, 4 or 8 warps: 0.068-0.070 ms; 2,048 keys 0.069)
CHUNK = 4096
BITS = 8  # a digit's bits: four levels cover a 32-bit key
WARPS = 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _keys(s_ptr, row, offs, S, stride_r):
    """int32 keys of a row's scores at offs whose signed order is the scores' (-0.0 made +0.0, a tie; negative
    floats' magnitude bits flipped); keys past S are the least int32 (below -inf's), never selected."""
    ok = offs < S
    x = tl.load(s_ptr + row.to(tl.int64) * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(ok, key, -2147483648), ok


@triton.jit
def _digit(key, LEVEL: tl.constexpr, BITS: tl.constexpr):
    """The key's digit at LEVEL: BITS bits from the top (fewer at the last level), the top digit's sign bit
    flipped so that digits order as the signed keys."""
    TOP: tl.constexpr = 32 - BITS * LEVEL
    WIDTH: tl.constexpr = BITS if BITS < TOP else TOP
    digit = (key >> (TOP - WIDTH)) & ((1 << WIDTH) - 1)
    if LEVEL == 0:
        digit = digit ^ (1 << (WIDTH - 1))
    return digit


@triton.jit
def _kth_digit(counts, need, BINS: tl.constexpr):
    """One level's counts per digit value (of the keys that share the digits above it), of which the selection takes
    `need` -> (the digit of the need-th best, how many of the keys at that digit it takes)."""
    bins = tl.arange(0, BINS)
    # keys at this digit or above, non-increasing in the digit: the need-th best is at the last digit where they
    # still reach `need`
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    digit = tl.sum((at_or_above >= need).to(tl.int32), 0) - 1
    return digit, need - tl.sum(tl.where(bins > digit, counts, 0), 0)


@triton.jit
def _descend(hist_ptr, row, k, LEVELS: tl.constexpr, BITS: tl.constexpr):
    """From the row's first LEVELS histograms (finished by earlier launches): the top bits of the k-th best key
    that those levels decide (the bits below them 0), and how many keys sharing them the selection still takes
    (k less the keys above them)."""
    BINS: tl.constexpr = 1 << BITS
    ALL: tl.constexpr = (32 + BITS - 1) // BITS
    bins = tl.arange(0, BINS)
    need = k
    prefix = 0
    for level in tl.static_range(LEVELS):
        digit, need = _kth_digit(tl.load(hist_ptr + (row * ALL + level).to(tl.int64) * BINS + bins), need, BINS)
        # (constexprs of the unrolled loop cannot be reassigned: plain names)
        top = 32 - BITS * level
        width = BITS if BITS < top else top
        if level == 0:
            digit = digit ^ (1 << (width - 1))
        prefix = prefix | (digit << (top - width))
    return prefix, need


@triton.jit
def _histogram_kernel(s_ptr, hist_ptr, S, stride_r, k, LEVEL: tl.constexpr, BITS: tl.constexpr,
                      CHUNK: tl.constexpr):
    """One level: the chunk's keys that share the digits chosen at the levels above, counted per digit at LEVEL
    into the row's histogram."""
    BINS: tl.constexpr = 1 << BITS
    ALL: tl.constexpr = (32 + BITS - 1) // BITS
    chunk, row = tl.program_id(0), tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    key, ok = _keys(s_ptr, row, offs, S, stride_r)
    mine = ok
    if LEVEL > 0:
        prefix, _ = _descend(hist_ptr, row, k, LEVEL, BITS)
        SHIFT: tl.constexpr = 32 - BITS * LEVEL
        mine = mine & ((key >> SHIFT) == (prefix >> SHIFT))
    # keys not counted go to digit 0 and come off its count again (no reliance on histogram's mask argument)
    counts = tl.histogram(tl.where(mine, _digit(key, LEVEL, BITS), 0), BINS)
    bins = tl.arange(0, BINS)
    counts -= tl.where(bins == 0, tl.sum((~mine).to(tl.int32), 0), 0)
    tl.atomic_add(hist_ptr + (row * ALL + LEVEL).to(tl.int64) * BINS + bins, counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _threshold(hist_ptr, row, k, BITS: tl.constexpr):
    """(the k-th best key of the row, how many keys equal to it the selection takes)."""
    LEVELS: tl.constexpr = (32 + BITS - 1) // BITS
    return _descend(hist_ptr, row, k, LEVELS, BITS)


@triton.jit
def _count_kernel(s_ptr, hist_ptr, count_ptr, S, stride_r, k, C, BITS: tl.constexpr, CHUNK: tl.constexpr):
    """Each chunk's keys above the threshold and equal to it: count[row, chunk] = (above, equal)."""
    chunk, row = tl.program_id(0), tl.program_id(1)
    key, ok = _keys(s_ptr, row, chunk * CHUNK + tl.arange(0, CHUNK), S, stride_r)
    threshold, _ = _threshold(hist_ptr, row, k, BITS)
    at = count_ptr + (row.to(tl.int64) * C + chunk) * 2
    tl.store(at, tl.sum((ok & (key > threshold)).to(tl.int32), 0))
    tl.store(at + 1, tl.sum((ok & (key == threshold)).to(tl.int32), 0))


@triton.jit
def _write_kernel(s_ptr, hist_ptr, count_ptr, out_ptr, S, stride_r, stride_o, k, C, BITS: tl.constexpr,
                  CHUNK: tl.constexpr, MAX_C: tl.constexpr):
    """The chunk's selected positions, in order, after those of the chunks before it: every key above the
    threshold, and of the keys equal to it those whose rank (by position, over the row) is below `need`."""
    chunk, row = tl.program_id(0), tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    key, ok = _keys(s_ptr, row, offs, S, stride_r)
    threshold, need = _threshold(hist_ptr, row, k, BITS)
    chunks = tl.arange(0, MAX_C)
    before = chunks < chunk
    row_counts = count_ptr + (row.to(tl.int64) * C + chunks) * 2
    above_before = tl.sum(tl.load(row_counts, mask=before, other=0), 0)
    equal_before = tl.sum(tl.load(row_counts + 1, mask=before, other=0), 0)
    equal = ok & (key == threshold)
    equal_rank = equal_before + tl.cumsum(equal.to(tl.int32), 0) - 1
    chosen = (ok & (key > threshold)) | (equal & (equal_rank < need))
    slot = above_before + tl.minimum(equal_before, need) + tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(out_ptr + row.to(tl.int64) * stride_o + slot, offs.to(tl.int64), mask=chosen)


def supported(scores_RS: torch.Tensor) -> bool:
    """CUDA rows of fp32 / bf16 / fp16 scores (rows that are not contiguous along the keys are made so)."""
    return scores_RS.is_cuda and scores_RS.dtype in _DTYPES


def topk_positions_triton(scores_RS: torch.Tensor, k: int, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """[R, k] int64 positions, ascending, of each row's k best keys by (score desc, position asc): topk.py's
    `topk_lowest_position` for 0 < k <= S. Scores must not be NaN. config: (BITS, CHUNK, WARPS), for benchmarks."""
    R, S = scores_RS.shape
    if not 0 < k <= S:
        raise ValueError(f"k must be in [1, S = {S}], got {k}")
    if scores_RS.stride(-1) != 1:
        scores_RS = scores_RS.contiguous()
    bits, chunk, warps = config or (BITS, CHUNK, WARPS)
    levels = triton.cdiv(32, bits)
    C = triton.cdiv(S, chunk)
    hist = torch.zeros(R, levels, 1 << bits, dtype=torch.int32, device=scores_RS.device)
    counts = torch.empty(R, C, 2, dtype=torch.int32, device=scores_RS.device)
    out = torch.empty(R, k, dtype=torch.long, device=scores_RS.device)
    grid, stride = (C, R), scores_RS.stride(0)
    with torch.cuda.device_of(scores_RS):
        for level in range(levels):
            _histogram_kernel[grid](scores_RS, hist, S, stride, k, LEVEL=level, BITS=bits, CHUNK=chunk,
                                    num_warps=warps)
        _count_kernel[grid](scores_RS, hist, counts, S, stride, k, C, BITS=bits, CHUNK=chunk, num_warps=warps)
        _write_kernel[grid](scores_RS, hist, counts, out, S, stride, out.stride(0), k, C, BITS=bits, CHUNK=chunk,
                            MAX_C=triton.next_power_of_2(C), num_warps=warps)
    return out
