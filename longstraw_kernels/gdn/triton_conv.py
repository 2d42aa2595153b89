"""GDN's short causal conv and its SiLU over many tokens in one Triton launch, for graph-free forwards (capture,
scoring): `causal_conv_silu`'s values, read from the input linear's [B, T, X] output and the window before it.

The model's path cats the window and the transposed input into a [B, X, W + T] copy, runs torch's depthwise conv
(a generic kernel for bf16), its SiLU, and hands on the transposed result, whose strided heads then cost a copy
each before the norms and fla's kernel: on an H100, qwen36_mini's capture at 256K spent ~0.5 s of ~7.5 s of kernels
there (2026-12-06); with this launch it took 7.22 / 7.24 s against 7.67 / 7.73 in `longstraw train` (BENCHMARKS).
Here a program owns BT tokens by BX channels of one sequence:

    out[b, t, x] = silu(round(sum_j w[x, j] in[b, t - W + j, x])),   in[b, s, x] = window[b, x, W + s] for s < 0

the sum in fp32 (j in order), rounded to the input's dtype as the conv's output is, SiLU in fp32, rounded. The
output is [B, T, X], contiguous: q, k and v are then views with one stride over the tokens.
tests/kernels/test_gdn_conv.py holds it to the reference in Triton's interpreter (CPU) and on CUDA (`-m gpu`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv_silu_tokens", "serves"]

BLOCK_T, BLOCK_X = 32, 128


def serves(mixed_BTX: torch.Tensor, window_BXW: torch.Tensor, weight_X1K: torch.Tensor) -> bool:
    return (mixed_BTX.dtype in (torch.bfloat16, torch.float16, torch.float32) and mixed_BTX.stride(-1) == 1
            and window_BXW.dtype == mixed_BTX.dtype and weight_X1K.is_contiguous()
            and weight_X1K.shape[-1] == window_BXW.shape[-1] + 1)


@triton.jit
def _conv_kernel(x_ptr, win_ptr, w_ptr, out_ptr, T, X, sxb, sxt, swb, swx, sww, K: tl.constexpr,
                 BT: tl.constexpr, BX: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BX + tl.arange(0, BX)
    mask_c = c < X
    acc = tl.zeros((BT, BX), dtype=tl.float32)
    for j in tl.static_range(K):
        # tap j reads token s = t - (K - 1) + j: the input's row s, or the window's column K - 1 + s before it
        s = t - (K - 1) + j
        inside = (s >= 0)[:, None] & (t < T)[:, None] & mask_c[None, :]
        before = (s < 0)[:, None] & (t < T)[:, None] & mask_c[None, :]
        v = tl.load(x_ptr + b * sxb + s[:, None].to(tl.int64) * sxt + c[None, :], mask=inside, other=0.0)
        v += tl.load(win_ptr + b * swb + c[None, :] * swx + (K - 1 + s)[:, None] * sww, mask=before, other=0.0)
        acc += v.to(tl.float32) * tl.load(w_ptr + c * K + j, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype).to(tl.float32)
    out = out_ptr + b * T * X + t[:, None].to(tl.int64) * X + c[None, :]
    tl.store(out, (y / (1.0 + tl.exp(-y))).to(dtype), mask=(t < T)[:, None] & mask_c[None, :])


def conv_silu_tokens(mixed_BTX: torch.Tensor, window_BXW: torch.Tensor, weight_X1K: torch.Tensor) -> torch.Tensor:
    """silu(conv) [B, T, X] contiguous, in mixed's dtype, where `serves`."""
    B, T, X = mixed_BTX.shape
    out = torch.empty(B, T, X, dtype=mixed_BTX.dtype, device=mixed_BTX.device)
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(X, BLOCK_X), B)
    _conv_kernel[grid](mixed_BTX, window_BXW, weight_X1K, out, T, X, mixed_BTX.stride(0), mixed_BTX.stride(1),
                       *window_BXW.stride(), K=weight_X1K.shape[-1], BT=BLOCK_T, BX=BLOCK_X, num_warps=4)
    return out
