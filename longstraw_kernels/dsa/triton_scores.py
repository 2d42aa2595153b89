"""DSA lightning-indexer scores as one fused Triton kernel: no [B, T, J, S] intermediate, fp32 scores written once.

One program owns a [BLOCK_T, BLOCK_S] tile of the scores of one sequence. It loads its key tile once, then for
each index head j: dot(q_j tile [BLOCK_T, I], key tile^T) -> relu -> times scale * w[:, j] -> accumulated in
fp32 (relu(scale x) w = relu(x) scale w for scale >= 0). With a causal `offset` (query t sees key s iff
s <= t + offset), a tile no query of which sees any of its keys is written -inf without loading anything; partly
visible tiles are masked element by element. For few query rows (the decode's) the heads are folded into the dot's
rows instead (`indexer_scores_folded_triton`): one dot of T x J rows a key tile, not J dots of T, by a few programs
an SM that loop over the key tiles.

Precision: q and k both bf16 (or both fp16) take the tensor-core dot with fp32 accumulation: a product of two
bf16 values is exact in fp32 (8 + 8 significant bits <= 24; fp16: 11 + 11), so this equals the fp32 reference up
to the order of summation. Anything else is computed in fp32 with input_precision="ieee": TF32 would round q and
k to 10-bit mantissas and flip near-ties of the top-k that follows. See README.md.

Legend: B batch, T queries, J index heads, I index head dim (BLOCK_I: I padded to a power of two >= 16),
S keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_DTYPES = (torch.float32,) + LOW_PRECISION_DTYPES
# (BLOCK_T, BLOCK_S, num_warps, num_stages) per dot precision. bf16: the fastest of bench_dsa.py's six tile
# shapes at every size of its H200 sweep (2026-11-29, J=16, I=128: 12% less time than 64x256x8x2, which ran at
# 434-456 TFLOP/s). The fp32 FMA dot holds its operands in registers: smaller tiles, or it spills (not timed).
LOW_PRECISION_CONFIG = (64, 128, 4, 2)
# few query rows (T <= 16) the folded form does not take (J not a power of two, or T x J over FOLDED_MAX_ROWS;
# glm52's decode takes the folded form): a 64-row tile runs 4-8x the dots they need. bench_dsa.py, H200, T = 8,
# S = 262,144, J = 16, I = 128 (2026-12-03): 0.081 ms against the 64-row tile's 0.138 (16x128x4x2 0.089,
# 16x256x8x2 0.092, 16x512x8x2 0.103, 16x64x4x2 0.115)
FEW_ROWS_CONFIG = (16, 256, 4, 2)
FP32_CONFIG = (64, 64, 8, 2)


@triton.jit
def _key_tile(k_base, ds_S, i_I, valid_S, I, stride_ks, stride_ki):
    """A key tile from its first key's address, transposed for the dot: [BLOCK_I, BLOCK_S]; padded dims and keys
    past S load 0 and add nothing to the dots."""
    return tl.load(k_base + ds_S[None, :] * stride_ks + i_I[:, None] * stride_ki,
                   mask=(i_I[:, None] < I) & valid_S[None, :], other=0.0)


@triton.jit
def _store_tile(out_base, acc_TS, t0, s0, dt_T, ds_S, valid_T, valid_S, offset, stride_ot, stride_os,
                HAS_OFFSET: tl.constexpr):
    """A [BLOCK_T, BLOCK_S] tile of scores at its corner's address, -inf where query t does not see key s
    (s > t + offset)."""
    if HAS_OFFSET:
        acc_TS = tl.where((s0 + ds_S)[None, :] <= (t0 + dt_T)[:, None] + offset, acc_TS, float("-inf"))
    tl.store(out_base + dt_T[:, None] * stride_ot + ds_S[None, :] * stride_os, acc_TS,
             mask=valid_T[:, None] & valid_S[None, :])


@triton.jit
def _folded_rows(q_base, w_base, t0, T, I, scale, stride_qt, stride_qj, stride_qi, stride_wt, stride_wj,
                 BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, FOLD_J: tl.constexpr):
    """A row tile's queries [BLOCK_T * FOLD_J, BLOCK_I] and scale * weights [BLOCK_T * FOLD_J], the heads folded
    into the rows: r = t * J + j."""
    r_R = tl.arange(0, BLOCK_T * FOLD_J)
    t_R, j_R = r_R // FOLD_J, r_R % FOLD_J
    i_I = tl.arange(0, BLOCK_I)
    valid_R = t0 + t_R < T
    q_RI = tl.load(q_base + t_R[:, None] * stride_qt + j_R[:, None] * stride_qj + i_I[None, :] * stride_qi,
                   mask=valid_R[:, None] & (i_I[None, :] < I), other=0.0)
    w_R = tl.load(w_base + t_R * stride_wt + j_R * stride_wj, mask=valid_R, other=0.0).to(tl.float32) * scale
    return q_RI, w_R


@triton.jit
def _folded_tile(q_RI, w_R, kT_IS, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, FOLD_J: tl.constexpr):
    """[BLOCK_T, BLOCK_S] scores of a key tile: one dot for the folded rows, relu, times w, each row's heads summed."""
    terms_RS = tl.maximum(tl.dot(q_RI, kT_IS, out_dtype=tl.float32), 0.0) * w_R[:, None]
    return tl.sum(tl.reshape(terms_RS, (BLOCK_T, FOLD_J, BLOCK_S)), axis=1)


@triton.jit
def _folded_loop_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr,
    T, S, I, scale, offset,
    stride_qb, stride_qt, stride_qj, stride_qi,
    stride_wb, stride_wt, stride_wj,
    stride_kb, stride_ks, stride_ki,
    stride_ob, stride_ot, stride_os,
    HAS_OFFSET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr,
    FOLD_J: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # few rows (the decode's), every row's FOLD_J = J heads folded into the dot's rows (r = t * J + j: one
    # [BLOCK_T * J, I] x [I, BLOCK_S] tensor-core dot for the J dots of BLOCK_T rows, each padded to 16, of the head
    # loop), by fewer programs than key tiles: a program loads its row tile's queries and weights once and loops over
    # key tiles pid, pid + programs, ..., the next tile's keys loaded while this one's dot runs (NUM_STAGES). Tiles no
    # query sees are computed and masked -inf (the decode's rows see nearly every key; the capture's many rows never
    # take the folded form)
    pid, b = tl.program_id(0), tl.program_id(2).to(tl.int64)
    t0 = tl.program_id(1) * BLOCK_T
    dt_T = tl.arange(0, BLOCK_T)
    ds_S = tl.arange(0, BLOCK_S)
    i_I = tl.arange(0, BLOCK_I)
    valid_T = t0 + dt_T < T
    q_RI, w_R = _folded_rows(q_ptr + b * stride_qb + t0.to(tl.int64) * stride_qt,
                             w_ptr + b * stride_wb + t0.to(tl.int64) * stride_wt, t0, T, I, scale, stride_qt,
                             stride_qj, stride_qi, stride_wt, stride_wj, BLOCK_T, BLOCK_I, FOLD_J)
    k_batch = k_ptr + b * stride_kb
    out_rows = out_ptr + b * stride_ob + t0.to(tl.int64) * stride_ot
    for tile in tl.range(pid, tl.cdiv(S, BLOCK_S), tl.num_programs(0), num_stages=NUM_STAGES):
        s0 = tile * BLOCK_S
        valid_S = s0 + ds_S < S
        kT_IS = _key_tile(k_batch + s0.to(tl.int64) * stride_ks, ds_S, i_I, valid_S, I, stride_ks, stride_ki)
        _store_tile(out_rows + s0.to(tl.int64) * stride_os, _folded_tile(q_RI, w_R, kT_IS, BLOCK_T, BLOCK_S, FOLD_J),
                    t0, s0, dt_T, ds_S, valid_T, valid_S, offset, stride_ot, stride_os, HAS_OFFSET)


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr,
    T, S, J, I, scale, offset,
    stride_qb, stride_qt, stride_qj, stride_qi,
    stride_wb, stride_wt, stride_wj,
    stride_kb, stride_ks, stride_ki,
    stride_ob, stride_ot, stride_os,
    HAS_OFFSET: tl.constexpr, LOW_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr,
):
    pid_s, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t0, s0 = pid_t * BLOCK_T, pid_s * BLOCK_S
    # tile-local positions; the tile's corner goes into 64-bit scalar bases (T * S alone passes 2^31 at long
    # prompts) and in-tile offsets stay 32-bit: [BLOCK_T, BLOCK_*] tensors of 64-bit pointers live across the
    # head loop would spill registers
    dt_T = tl.arange(0, BLOCK_T)
    ds_S = tl.arange(0, BLOCK_S)
    i_I = tl.arange(0, BLOCK_I)
    valid_T = t0 + dt_T < T
    valid_S = s0 + ds_S < S
    out_base = out_ptr + b * stride_ob + t0.to(tl.int64) * stride_ot + s0.to(tl.int64) * stride_os
    # the tile's last real query sees up to key t_last + offset; keys past it are invisible to the whole tile
    # (without HAS_OFFSET the caller passes offset = S: nothing is skipped)
    t_last = tl.minimum(t0 + BLOCK_T, T) - 1
    if s0 > t_last + offset:
        tl.store(out_base + dt_T[:, None] * stride_ot + ds_S[None, :] * stride_os,
                 tl.full((BLOCK_T, BLOCK_S), float("-inf"), tl.float32), mask=valid_T[:, None] & valid_S[None, :])
    else:
        kT_IS = _key_tile(k_ptr + b * stride_kb + s0.to(tl.int64) * stride_ks, ds_S, i_I, valid_S, I, stride_ks,
                          stride_ki)
        q_base = q_ptr + b * stride_qb + t0.to(tl.int64) * stride_qt
        w_base = w_ptr + b * stride_wb + t0.to(tl.int64) * stride_wt
        acc_TS = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.float32)
        for j in range(J):
            q_TI = tl.load(q_base + j * stride_qj + dt_T[:, None] * stride_qt + i_I[None, :] * stride_qi,
                           mask=valid_T[:, None] & (i_I[None, :] < I), other=0.0)
            # relu(scale * x) * w = relu(x) * (scale * w) for scale >= 0: one multiply less per score
            w_T = tl.load(w_base + j * stride_wj + dt_T * stride_wt, mask=valid_T, other=0.0).to(tl.float32) * scale
            if LOW_PRECISION:
                dots_TS = tl.dot(q_TI, kT_IS, out_dtype=tl.float32)
            else:
                dots_TS = tl.dot(q_TI.to(tl.float32), kT_IS.to(tl.float32), input_precision="ieee",
                                 out_dtype=tl.float32)
            acc_TS += tl.maximum(dots_TS, 0.0) * w_T[:, None]
        _store_tile(out_base, acc_TS, t0, s0, dt_T, ds_S, valid_T, valid_S, offset, stride_ot, stride_os, HAS_OFFSET)


# the folded kernel's rows a program (BLOCK_T * J) times its keys: its fp32 [rows, BLOCK_S] tile's elements. On an
# H200 at 8 rows of 262K keys (bench_dsa.py, 2026-12-04) the best key block was 64 at J = 16 (0.043 ms; 128: 0.061)
# and 32 at J = 32 (0.084 ms; 64: 0.089); one program a key tile (deleted) was 0.048 and 0.098 at its best
FOLDED_TILE_ELEMENTS = 8192
FOLDED_MAX_ROWS = 512


def folded_serves(q_BTJI: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `indexer_scores_folded_triton` takes these: bf16 / fp16 q and k alike, J a power of two, and at most
    FOLDED_MAX_ROWS folded rows (T padded to a power of two, times J)."""
    _, T, J, _ = q_BTJI.shape
    return (q_BTJI.dtype == k.dtype and q_BTJI.dtype in LOW_PRECISION_DTYPES and J & (J - 1) == 0
            and triton.next_power_of_2(max(T, 1)) * J <= FOLDED_MAX_ROWS)


def indexer_scores_folded_triton(q_BTJI: torch.Tensor, w_BTJ: torch.Tensor, k: torch.Tensor, scale: float,
                                 offset: int | None = None, *, block_s: int | None = None,
                                 num_warps: int = 8, programs: int | None = None) -> torch.Tensor:
    """`indexer_scores_triton` for few query rows (`folded_serves`), the heads folded into the dot's rows, as
    `programs` programs a row tile and sequence looping over the key tiles (`_folded_loop_kernel`; default
    `folded_loop_programs`). block_s: keys a tile (default: FOLDED_TILE_ELEMENTS over the folded rows, 16 to 256)."""
    _, T, J, _ = q_BTJI.shape
    if not folded_serves(q_BTJI, k):
        raise ValueError(f"the folded kernel takes bf16/fp16 q and k alike, J a power of two and T x J <= "
                         f"{FOLDED_MAX_ROWS}; got q {q_BTJI.dtype} {tuple(q_BTJI.shape)}, k {k.dtype}")
    # T padded to a power of two, and the folded rows to the dot's least 16
    block_t = max(triton.next_power_of_2(max(T, 1)), 16 // J)
    if block_s is None:
        block_s = min(256, max(16, FOLDED_TILE_ELEMENTS // (block_t * J)))
    if programs is None:
        programs = folded_loop_programs(q_BTJI.device)
    return indexer_scores_triton(q_BTJI, w_BTJ, k, scale, offset, config=(block_t, block_s, num_warps, 2),
                                 programs=programs)


# the folded loop's programs per SM (untuned)
FOLDED_PROGRAMS_PER_SM = 2


def folded_loop_programs(device: torch.device) -> int:
    """The folded loop's programs for `device`: FOLDED_PROGRAMS_PER_SM a streaming multiprocessor (off CUDA, in
    Triton's interpreter, FOLDED_PROGRAMS_PER_SM)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return FOLDED_PROGRAMS_PER_SM * sms


def indexer_scores_triton(q_BTJI: torch.Tensor, w_BTJ: torch.Tensor, k: torch.Tensor, scale: float,
                          offset: int | None = None, *, config: tuple[int, int, int, int] | None = None,
                          programs: int | None = None) -> torch.Tensor:
    """Same contract as `reference.indexer_scores_reference`, for fp32 / bf16 / fp16 q and k: -> [B, T, S] fp32.
    `config` = (BLOCK_T, BLOCK_S, num_warps, num_stages), powers of two, blocks >= 16; None: the default of the
    dot's precision. programs: the heads folded into the dot's rows, that many programs looping over the key tiles
    (`indexer_scores_folded_triton` checks it serves and sizes the config)."""
    B, T, J, I = q_BTJI.shape
    if q_BTJI.dtype not in SUPPORTED_DTYPES or k.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"indexer_scores_triton takes q and k in {SUPPORTED_DTYPES}, got {q_BTJI.dtype} and "
                         f"{k.dtype}; the reference takes any dtype")
    if k.dim() not in (2, 3) or k.shape[-1] != I or (k.dim() == 3 and k.shape[0] != B):
        raise ValueError(f"keys must be [S, {I}] or [{B}, S, {I}], got {tuple(k.shape)}")
    if w_BTJ.shape != (B, T, J):
        raise ValueError(f"w must be [{B}, {T}, {J}], got {tuple(w_BTJ.shape)}")
    if not scale >= 0:
        raise ValueError(f"scale must be >= 0 (the kernel moves it past the ReLU), got {scale}")
    S = k.shape[-2]
    out_BTS = torch.empty(B, T, S, dtype=torch.float32, device=q_BTJI.device)
    if out_BTS.numel() == 0:
        return out_BTS
    low_precision = q_BTJI.dtype == k.dtype and q_BTJI.dtype in LOW_PRECISION_DTYPES
    if config is None and low_precision:
        config = FEW_ROWS_CONFIG if T <= FEW_ROWS_CONFIG[0] else LOW_PRECISION_CONFIG
    block_t, block_s, num_warps, num_stages = config or FP32_CONFIG
    # in-tile offsets are 32-bit (see the kernel)
    row_stride = max(out_BTS.stride(1), q_BTJI.stride(1), w_BTJ.stride(1))
    if block_t * row_stride >= 2**31 or block_s * k.stride(-2) >= 2**31:
        raise ValueError(f"S={S} keys (row stride {row_stride}) overflow 32-bit in-tile offsets at block_t={block_t}")
    # a shared key group is read by every sequence: batch stride 0
    stride_kb = k.stride(0) if k.dim() == 3 else 0
    args = (q_BTJI, w_BTJ, k, out_BTS)
    strides = (*q_BTJI.stride(), *w_BTJ.stride(), stride_kb, k.stride(-2), k.stride(-1), *out_BTS.stride())
    offset_arg = S if offset is None else int(offset)
    block_i = max(16, triton.next_power_of_2(I))
    if programs is not None:
        grid = (min(programs, triton.cdiv(S, block_s)), triton.cdiv(T, block_t), B)
        _folded_loop_kernel[grid](*args, T, S, I, float(scale), offset_arg, *strides, HAS_OFFSET=offset is not None,
                                  BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_I=block_i, FOLD_J=J, NUM_STAGES=num_stages,
                                  num_warps=num_warps)
        return out_BTS
    # key tiles vary fastest: programs running together share one query tile (all J heads of it stay in L2) and
    # stream the keys once per query tile
    grid = (triton.cdiv(S, block_s), triton.cdiv(T, block_t), B)
    _indexer_scores_kernel[grid](
        *args, T, S, J, I, float(scale), offset_arg, *strides,
        HAS_OFFSET=offset is not None,
        LOW_PRECISION=low_precision,
        BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_I=block_i,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out_BTS
