"""The DSA selection rule (topk.py) for the capture's calls, many rows of many keys (2^27 scores a call), in Triton:
one program a row, two reads of the row (more for a row past its cap), no sort.

A row's scores become topk.py's order-preserving 32-bit keys (triton_topk's `_keys`). The program
  1. reads the row once for the maxima of its chunks of CHUNK keys (at most MAXIMA chunks, written to a scratch row);
  2. finds t, the k-th largest of those maxima (a bisection over the 32-bit keys, the maxima in registers): k chunks
     have a key >= t, so the row's k-th best key is >= t and every key the rule selects, ties at the k-th place
     included, is >= t;
  3. reads the row again and appends its keys >= t, with their positions, to a candidates row (at most CAP, in
     position order: a running count and a scan a block);
  4. runs the rule on the candidates in registers: T, their k-th largest key (a bisection), then every key above T
     and, of the keys equal to T, the first `need` by position; their positions come out ascending.
For independent scores the candidates are 1.15k-1.4k, by computation (a row has 2k to 4k chunks at k = 2,048; the
count was not measured on real scores). A row with more than CAP (scores rising along the row, many ties, fewer
than about half its keys visible) runs the rule over the whole row in the same program instead (5.): a read for
the keys above the bound (fewer than k: the k-th place ties at it), else T's bits below those that the bound + 1
and the row's largest key share, DIGIT of them a read of the row (a histogram of the next digit), then one read
writes the positions. So the call never synchronises with the host: the capture's queue of kernels stays full (until
2026-12-06 the host read which rows overflowed after every call, and ran torch.topk's whole-row rule on them).

On one H100 a call of 2^27 scores (512 rows of 262,144 keys, k = 2,048) takes 1.06 ms against the whole-row
torch.topk rule's 2.29; glm52_mini's capture at 256K in `longstraw train` (1,024 such calls) 7.48-7.56 s against
8.20-8.23 (docs/BENCHMARKS.md, 2026-12-06). Without the host's read of the overflowing rows (one H200): 0.93 ms a
call against 1.03, and with the MoE's grouping also free of synchronisations the capture 7.04-7.06 s against
7.27-7.49; where a tenth of the rows overflow (rising along the keys) 2.07 ms against 1.90. The overflowing rows'
rule by digits (2026-12-07, one H100, against the bisection it replaced, alternated in one process): 1.59 ms against
2.00 with a tenth of the rows overflowing, 3.69 against 5.72 with all of them, 2.27 against 2.29 where all tie at
the bound (sparse ReLU scores), 0.95 either way where none overflows; 4 bits a read against 5: 5 was 2-3% faster on
the overflowing rows and no faster on the others, so 4 stays.

Exact: keys and counts are integers, nothing is rounded (tests/kernels/test_dsa_topk.py: Triton's interpreter on
CPU, and the GPU).

Legend: R rows, S keys per row, k selected.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from longstraw_kernels.dsa.triton_topk import _keys, _kth_digit

__all__ = ["CAP", "MAXIMA", "chunk_size", "precompile", "serves", "threshold_positions_triton"]

# chunk maxima a row (in the registers of one program), candidates a row, keys a step of the row's reads, the reads'
# stages. On one H100 (bench_topk.py --sweep, 2026-12-06; ms a call of 2^27 scores at 16K / 64K / 256K / 1M keys a
# row): 2.39 / 1.36 / 1.11 / 0.99 against 2.64 / 1.30 / 1.24 / 1.47 in one stage. 4,096 maxima ran 1.60 / 1.37 / 1.05
# / 1.73 in one stage, but rows with half their keys masked then leave too loose a bound (each row past CAP); four
# launches, each read spread over programs a block (atomic appends, a tl.sort of the selected), ran 5.03 / 2.06 /
# 1.23 / 1.05 (a probe script, never committed)
MAXIMA = 8192
CAP = 4096
BLOCK = 4096
WARPS = 8
STAGES = 3
# bits of T a read of an overflowing row finds (its histogram: 2^(DIGIT + 1) bins); 5 measured faster on those rows
# only (module note)
DIGIT = 4
# the fewest keys a row measured (there 2.39 ms against the whole-row rule's 3.71-3.98); shorter rows take the rule
MIN_KEYS = 16384


def serves(scores_RS: torch.Tensor, k: int) -> bool:
    """CUDA fp32 rows of at least MIN_KEYS keys, k at most min(CAP, MAXIMA) / 2."""
    return scores_RS.is_cuda and scores_RS.dtype == torch.float32 and _serves_keys(scores_RS.shape[-1], k)


def _serves_keys(S: int, k: int) -> bool:
    """Rows of S keys, k of them selected: `serves`' bounds."""
    return S >= MIN_KEYS and 0 < k <= min(CAP, MAXIMA) // 2


def _meta(chunk: int, maxima: int, cap: int, block: int, stages: int, warps: int) -> dict:
    """`_select_kernel`'s compile-time arguments and warps: what a launch and the warm-up of its rows share."""
    return dict(CHUNK=chunk, MAXIMA=maxima, CAP=cap, BLOCK=max(block, chunk), STAGES=stages, DIGIT=DIGIT,
                num_warps=warps)


def chunk_size(S: int, maxima: int = MAXIMA) -> int:
    """The select's CHUNK for rows of S keys: the least power of two that leaves at most `maxima` chunks (and so
    more than maxima / 2 >= k of them)."""
    return triton.next_power_of_2(triton.cdiv(S, maxima))


def precompile(longest: int, k: int) -> int:
    """Compile the select, in threads at once, for each CHUNK that rows of MIN_KEYS to `longest` keys take, and
    for rows of exactly `longest` keys -> how many compiles. CHUNK is a compile-time constant that doubles with a
    row's keys, so a capture would otherwise compile one size after another as its blocks grow (five to 256K, seven
    to 1M), and Triton's compiler leaves Python's lock while it works: on one H100's host (Triton 3.6, 2026-12-07)
    five took 2.76 s at once against 11.62 one after another. Triton also specialises an integer argument on its
    divisibility by 16: the warm-ups take row lengths that are multiples of 16, as full blocks' are, and `longest`
    itself, the last block's (a prompt of P tokens captures P - 1); other rows compile at their first call."""
    if not _serves_keys(longest, k):
        return 0
    sizes = [chunk_size(MIN_KEYS) << i for i in range((chunk_size(longest) // chunk_size(MIN_KEYS)).bit_length())]
    # a row length of each chunk size, a multiple of 16; and the longest rows'
    rows = [MAXIMA * chunk // 2 + 16 for chunk in sizes] + ([longest] if longest % 16 else [])
    # Triton's asynchronous mode compiles each warm-up on the pool (where the running Triton has it); the
    # kernel's per-device caches are set up by the first warm-up, on this thread
    mode = getattr(triton, "AsyncCompileMode", None)
    with ThreadPoolExecutor(len(rows)) as pool, (mode(pool) if mode else nullcontext()):
        for S in rows:
            _select_kernel.warmup(torch.float32, torch.int32, torch.int32, torch.int32, torch.int32, torch.int64,
                                  S, k, S, k, grid=(1,), **_meta(chunk_size(S), MAXIMA, CAP, BLOCK, STAGES, WARPS))
    return len(rows)


@triton.jit
def _kth_largest(keys, k):
    """The k-th largest of int32 `keys` (keys INT32_MIN are padding: the result stays above it while k real keys
    exist): 32 halvings of [INT32_MIN, INT32_MAX] to the largest T with at least k keys >= T."""
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((keys >= mid.to(tl.int32)).to(tl.int32), 0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _select_kernel(s_ptr, max_ptr, key_ptr, pos_ptr, count_ptr, out_ptr, S, k, stride_r, stride_o,
                   CHUNK: tl.constexpr, MAXIMA: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                   STAGES: tl.constexpr, DIGIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    steps = tl.arange(0, BLOCK)
    # 1. the chunks' maxima (chunks past S: INT32_MIN, as the keys past S)
    PER_BLOCK: tl.constexpr = BLOCK // CHUNK
    maxima_row = max_ptr + row * MAXIMA
    for s0 in tl.range(0, S, BLOCK, num_stages=STAGES):
        key, _ = _keys(s_ptr, row, s0 + steps, S, stride_r)
        chunk = s0 // CHUNK + tl.arange(0, PER_BLOCK)
        tl.store(maxima_row + chunk, tl.max(tl.reshape(key, (PER_BLOCK, CHUNK)), axis=1), mask=chunk < MAXIMA)
    tl.debug_barrier()  # the maxima other threads stored, read back whole
    chunks = tl.arange(0, MAXIMA)
    maxima = tl.load(maxima_row + chunks, mask=chunks < tl.cdiv(S, CHUNK), other=-2147483648)
    # 2. the bound
    t = _kth_largest(maxima, k)
    # 3. the keys at or above it, in position order
    count = tl.zeros((), tl.int32)
    keys_row, positions_row = key_ptr + row * CAP, pos_ptr + row * CAP
    for s0 in tl.range(0, S, BLOCK, num_stages=STAGES):
        key, ok = _keys(s_ptr, row, s0 + steps, S, stride_r)
        keep = ok & (key >= t)
        kept = tl.sum(keep.to(tl.int32), 0)
        if kept > 0:
            slot = count + tl.cumsum(keep.to(tl.int32), 0) - 1
            put = keep & (slot < CAP)
            tl.store(keys_row + slot, key, mask=put)
            tl.store(positions_row + slot, s0 + steps, mask=put)
            count += kept
    tl.store(count_ptr + row, count)
    if count <= CAP:
        tl.debug_barrier()
        # 4. the rule on the candidates
        slots = tl.arange(0, CAP)
        held = slots < count
        key = tl.load(keys_row + slots, mask=held, other=-2147483648)
        position = tl.load(positions_row + slots, mask=held, other=0)
        T = _kth_largest(key, k)
        need = k - tl.sum((key > T).to(tl.int32), 0)
        tie = key == T
        chosen = (key > T) | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need))
        slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(out_ptr + row * stride_o + slot, position.to(tl.int64), mask=chosen)
    else:
        # 5. more candidates than CAP: the rule over the whole row, read again per digit of T
        _whole_row_rule(s_ptr, out_ptr, row, S, k, t, tl.max(maxima, 0), stride_r, stride_o, BLOCK, STAGES, DIGIT)


@triton.jit
def _count_above(s_ptr, row, S, stride_r, bound, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """The row's keys > bound (an int32 key), one read of the row."""
    steps = tl.arange(0, BLOCK)
    n = tl.zeros((), tl.int32)
    for s0 in tl.range(0, S, BLOCK, num_stages=STAGES):
        key, _ = _keys(s_ptr, row, s0 + steps, S, stride_r)
        n += tl.sum((key > bound).to(tl.int32), 0)
    return n


@triton.jit
def _whole_row_rule(s_ptr, out_ptr, row, S, k, t, top, stride_r, stride_o, BLOCK: tl.constexpr,
                    STAGES: tl.constexpr, DIGIT: tl.constexpr):
    """The rule on a row whose candidates overflowed: T, the k-th largest key, lies in [t, top] (t the maxima's
    bound: at least k keys >= t; top the row's largest key). A first read counts the keys above t: fewer than k,
    and T is t (the k-th place ties at the bound, as where many keys are zeros). Otherwise T lies in [t + 1, top]
    and shares the bits above which those two differ; its other bits are found DIGIT bits a read of the row, from
    the top down: a read counts, per value of the next digit, the keys that share the bits found so far (a
    histogram, taken only in blocks of the row that hold such keys), and T's digit is where the keys at or above it
    reach `need`, k less the keys above T's prefix (triton_topk's `_kth_digit`, as the decode's radix select
    descends): at most 1 + 32 / DIGIT reads, none where t is the row's largest key (a row all -inf or all zeros).
    Then one read writes the keys above T and the first `need` equal to T. Keys are taken as unsigned (key + 2^31,
    in int64), whose bits order as the keys do."""
    DIGITS: tl.constexpr = 1 << DIGIT
    # the histogram's bins: a digit's value, or the last bin for keys that do not share the prefix (or are masked)
    BINS: tl.constexpr = 2 * DIGITS
    ut = t.to(tl.int64) + 2147483648
    utop = top.to(tl.int64) + 2147483648
    need = k  # of the keys that share T's prefix (none lies above the row's largest key)
    if ut < utop:
        n = _count_above(s_ptr, row, S, stride_r, t, BLOCK, STAGES)
        if n < k:  # T is t: no digit to find
            need = k - n
            utop = ut
        else:
            ut = ut + 1
    # the low bits still to find, in whole digits: above them the bounds (and so T) agree
    low = tl.zeros((), tl.int32)
    while (ut >> low) != (utop >> low):
        low += DIGIT
    prefix = utop >> low
    steps = tl.arange(0, BLOCK)
    bins = tl.arange(0, BINS)
    while low > 0:
        low -= DIGIT
        counts = tl.zeros([BINS], tl.int32)
        for s0 in tl.range(0, S, BLOCK, num_stages=STAGES):
            key, ok = _keys(s_ptr, row, s0 + steps, S, stride_r)
            u = key.to(tl.int64) + 2147483648
            shares = ok & ((u >> (low + DIGIT)) == prefix)
            if tl.sum(shares.to(tl.int32), 0) > 0:
                digit = tl.where(shares, ((u >> low) & (DIGITS - 1)).to(tl.int32), BINS - 1)
                counts += tl.histogram(digit, BINS)
        d, need = _kth_digit(tl.where(bins < DIGITS, counts, 0), need, BINS)
        prefix = prefix * DIGITS + d
    T = (prefix - 2147483648).to(tl.int32)
    written = tl.zeros((), tl.int32)
    ties = tl.zeros((), tl.int32)
    for s0 in tl.range(0, S, BLOCK, num_stages=STAGES):
        key, ok = _keys(s_ptr, row, s0 + steps, S, stride_r)
        tie = ok & (key == T)
        chosen = (ok & (key > T)) | (tie & (ties + tl.cumsum(tie.to(tl.int32), 0) <= need))
        slot = written + tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(out_ptr + row * stride_o + slot, (s0 + steps).to(tl.int64), mask=chosen)
        written += tl.sum(chosen.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)


def threshold_positions_triton(scores_RS: torch.Tensor, k: int, *, maxima: int | None = None, cap: int | None = None,
                               block: int = BLOCK, warps: int = WARPS,
                               stages: int = STAGES) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (positions [R, k] int64, ascending, of each row's k best keys by (score desc, position asc), each row's
    candidates [R] int32: past `cap`, the row took the whole-row rule). No host synchronisation.
    0 < k <= min(cap, maxima) / 2; fp32 / bf16 / fp16 scores, not NaN. maxima, cap, block (powers of two), warps
    and stages (of the reads' loops): for tests and benchmarks (default: the module's MAXIMA, CAP, ...)."""
    R, S = scores_RS.shape
    maxima, cap = maxima or MAXIMA, cap or CAP
    if not 0 < k <= min(S, cap // 2, maxima // 2):
        raise ValueError(f"k must be in [1, min(S = {S}, cap / 2 = {cap // 2}, maxima / 2 = {maxima // 2})], "
                         f"got {k}")
    if scores_RS.stride(-1) != 1:
        scores_RS = scores_RS.contiguous()
    chunk = chunk_size(S, maxima)
    device = scores_RS.device
    scratch_max = torch.empty(R, maxima, dtype=torch.int32, device=device)
    keys = torch.empty(R, cap, dtype=torch.int32, device=device)
    positions = torch.empty(R, cap, dtype=torch.int32, device=device)
    count = torch.empty(R, dtype=torch.int32, device=device)
    out = torch.empty(R, k, dtype=torch.long, device=device)
    with torch.cuda.device_of(scores_RS):
        _select_kernel[(R,)](scores_RS, scratch_max, keys, positions, count, out, S, k, scores_RS.stride(0),
                             out.stride(0), **_meta(chunk, maxima, cap, block, stages, warps))
    return out, count
