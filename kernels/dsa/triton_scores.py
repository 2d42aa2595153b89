"""DSA lightning-indexer scores as one fused Triton kernel: no [B, T, J, S] intermediate, fp32 scores written once.

One program owns a [BLOCK_T, BLOCK_S] tile of the scores of one sequence. It loads its key tile once, then for
each index head j: dot(q_j tile [BLOCK_T, I], key tile^T) -> relu(scale * .) -> times w[:, j] -> accumulated in
fp32. With a causal `offset` (query t sees key s iff s <= t + offset), a tile no query of which sees any of its
keys is written -inf without loading anything; partly visible tiles are masked element by element.

Precision: q and k both bf16 (or both fp16) take the tensor-core dot with fp32 accumulation: a product of two
bf16 values is exact in fp32 (8 + 8 significant bits <= 24), so this equals the fp32 reference up to the order of
summation. Anything else is computed in fp32 with input_precision="ieee": TF32 would round q and k to 10-bit
mantissas and flip near-ties of the top-k that follows. See README.md.

Legend: B batch, T queries, J index heads, I index head dim (BLOCK_I: I padded to a power of two >= 16),
S keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_DTYPES = (torch.float32,) + LOW_PRECISION_DTYPES
# an H200 default; the benchmark sweeps others
BLOCK_T, BLOCK_S, NUM_WARPS, NUM_STAGES = 64, 128, 4, 2


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
    pid_t, pid_s, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t0, s0 = pid_t * BLOCK_T, pid_s * BLOCK_S
    t_T = t0 + tl.arange(0, BLOCK_T)
    s_S = s0 + tl.arange(0, BLOCK_S)
    i_I = tl.arange(0, BLOCK_I)
    valid_TS = (t_T[:, None] < T) & (s_S[None, :] < S)
    # int64 before multiplying: T * S alone passes 2^31 at long prompts
    out_ptrs = (out_ptr + b * stride_ob + t_T.to(tl.int64)[:, None] * stride_ot
                + s_S.to(tl.int64)[None, :] * stride_os)
    # the tile's last real query sees up to key t_last + offset; keys past it are invisible to the whole tile
    # (without HAS_OFFSET the caller passes offset = S: nothing is skipped)
    t_last = tl.minimum(t0 + BLOCK_T, T) - 1
    if s0 > t_last + offset:
        tl.store(out_ptrs, tl.full((BLOCK_T, BLOCK_S), float("-inf"), tl.float32), mask=valid_TS)
    else:
        # key tile, transposed for the dot: [BLOCK_I, BLOCK_S]; padded dims load 0 and add nothing to the dots
        k_ptrs = (k_ptr + b * stride_kb + s_S.to(tl.int64)[None, :] * stride_ks
                  + i_I[:, None].to(tl.int64) * stride_ki)
        kT_IS = tl.load(k_ptrs, mask=(i_I[:, None] < I) & (s_S[None, :] < S), other=0.0)
        q_ptrs = q_ptr + b * stride_qb + t_T.to(tl.int64)[:, None] * stride_qt + i_I[None, :] * stride_qi
        q_mask_TI = (t_T[:, None] < T) & (i_I[None, :] < I)
        w_ptrs = w_ptr + b * stride_wb + t_T.to(tl.int64) * stride_wt
        acc_TS = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.float32)
        for j in range(J):
            q_TI = tl.load(q_ptrs + j * stride_qj, mask=q_mask_TI, other=0.0)
            w_T = tl.load(w_ptrs + j * stride_wj, mask=t_T < T, other=0.0).to(tl.float32)
            if LOW_PRECISION:
                dots_TS = tl.dot(q_TI, kT_IS, out_dtype=tl.float32)
            else:
                dots_TS = tl.dot(q_TI.to(tl.float32), kT_IS.to(tl.float32), input_precision="ieee",
                                 out_dtype=tl.float32)
            acc_TS += tl.maximum(dots_TS * scale, 0.0) * w_T[:, None]
        if HAS_OFFSET:
            visible_TS = s_S[None, :] <= t_T[:, None] + offset
            acc_TS = tl.where(visible_TS, acc_TS, float("-inf"))
        tl.store(out_ptrs, acc_TS, mask=valid_TS)


def indexer_scores_triton(q_BTJI: torch.Tensor, w_BTJ: torch.Tensor, k: torch.Tensor, scale: float,
                          offset: int | None = None, *, block_t: int = BLOCK_T, block_s: int = BLOCK_S,
                          num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES) -> torch.Tensor:
    """Same contract as `reference.indexer_scores_reference`, for fp32 / bf16 / fp16 q and k: -> [B, T, S] fp32."""
    B, T, J, I = q_BTJI.shape
    if q_BTJI.dtype not in SUPPORTED_DTYPES or k.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"indexer_scores_triton takes q and k in {SUPPORTED_DTYPES}, got {q_BTJI.dtype} and "
                         f"{k.dtype}; the reference takes any dtype")
    if k.dim() not in (2, 3) or k.shape[-1] != I or (k.dim() == 3 and k.shape[0] != B):
        raise ValueError(f"keys must be [S, {I}] or [{B}, S, {I}], got {tuple(k.shape)}")
    if w_BTJ.shape != (B, T, J):
        raise ValueError(f"w must be [{B}, {T}, {J}], got {tuple(w_BTJ.shape)}")
    S = k.shape[-2]
    out_BTS = torch.empty(B, T, S, dtype=torch.float32, device=q_BTJI.device)
    if out_BTS.numel() == 0:
        return out_BTS
    # a shared key group is read by every sequence: batch stride 0
    stride_kb = k.stride(0) if k.dim() == 3 else 0
    grid = (triton.cdiv(T, block_t), triton.cdiv(S, block_s), B)
    _indexer_scores_kernel[grid](
        q_BTJI, w_BTJ, k, out_BTS,
        T, S, J, I, float(scale), S if offset is None else int(offset),
        *q_BTJI.stride(), *w_BTJ.stride(), stride_kb, k.stride(-2), k.stride(-1), *out_BTS.stride(),
        HAS_OFFSET=offset is not None,
        LOW_PRECISION=q_BTJI.dtype == k.dtype and q_BTJI.dtype in LOW_PRECISION_DTYPES,
        BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_I=max(16, triton.next_power_of_2(I)),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out_BTS
