"""qwen36's norms and both families' MLP gate, each in one Triton launch, for graph-free forwards (capture, scoring).

In eager torch each of these is a chain of kernels over fp32 copies of the rows: `rms_norm_one_plus` is seven
passes over an [T, C] tensor (the fp32 copy, pow, mean, two products, the cast), and the gated norm, the L2 norm
and SiLU(gate) * up the same. A launch here reads its inputs once and writes its output once, with the reference's
roundings:

    rms_norm       (x rsqrt(mean(x^2) + eps)) (1 + g), fp32, rounded to x's dtype    (linear/reference.py)
    gated_norm     w round(x rsqrt(mean(x^2) + eps)), rounded; times silu(z) fp32, rounded  (linear/reference.py)
    l2norm_fp32    x rsqrt(sum(x^2) + eps) in fp32, kept fp32                          (gdn/reference.py `l2norm`)
    silu_mul       round(silu(gate)) up, rounded                                       (core.py `MLP.swiglu`)

A row's sum of squares adds in another order than torch's (a last bit of the output, rarely); the rest is the same
arithmetic. Rows are the last dim, contiguous; the leading dims are read in place as [outer, heads] with a stride each
(the dims before the heads must flatten to one): a view of a wider GEMM output, as qwen36's query heads beside their
gates or GDN's key heads in the conv's output, needs no copy. Outputs are new and contiguous.
tests/kernels/test_norm.py holds each to its reference in Triton's interpreter (CPU) and on CUDA (`-m gpu`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gated_norm", "l2norm_fp32", "rms_norm", "rows_of", "silu_mul"]

# elements a program holds: two rows of qwen36_mini's hidden size, or sixteen of its 256-wide heads
TILE = 4096


def rows_of(x: torch.Tensor) -> torch.Tensor | None:
    """x as [outer, heads, N] without a copy (the last dim contiguous, the dims before the heads one stride), or
    None. Row r is [r // heads, r % heads]."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-2] if x.dim() > 1 else 1, x.shape[-1])
    except RuntimeError:
        return None


@triton.jit
def _row_tile(x_ptr, stride_o, stride_h, H, R, N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows of x ([R // H, H, N], strided) as fp32 [ROWS, BLOCK_N] (zeros outside), their offsets in
    a contiguous [R, N] output and the mask."""
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    mask = (r < R)[:, None] & (n < N)[None, :]
    at = (r // H) * stride_o + (r % H) * stride_h
    x = tl.load(x_ptr + at[:, None] + n[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, r[:, None] * N + n[None, :], mask


@triton.jit
def _rms_kernel(x_ptr, g_ptr, out_ptr, R, H, sxo, sxh, eps, N: tl.constexpr, BLOCK_N: tl.constexpr,
                ROWS: tl.constexpr):
    x, offs, mask = _row_tile(x_ptr, sxo, sxh, H, R, N, BLOCK_N, ROWS)
    n = tl.arange(0, BLOCK_N)
    g = tl.load(g_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
    tl.store(out_ptr + offs, ((x * scale[:, None]) * (1.0 + g)[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_kernel(x_ptr, z_ptr, w_ptr, out_ptr, R, H, sxo, sxh, szo, szh, eps, N: tl.constexpr,
                  BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    x, offs, mask = _row_tile(x_ptr, sxo, sxh, H, R, N, BLOCK_N, ROWS)
    z, _, _ = _row_tile(z_ptr, szo, szh, H, R, N, BLOCK_N, ROWS)
    n = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    h = (x * tl.rsqrt(tl.sum(x * x, 1) / N + eps)[:, None]).to(dtype).to(tl.float32)
    h = (w[None, :] * h).to(dtype).to(tl.float32)
    tl.store(out_ptr + offs, (h * (z / (1.0 + tl.exp(-z)))).to(dtype), mask=mask)


@triton.jit
def _l2_kernel(x_ptr, out_ptr, R, H, sxo, sxh, eps, N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    x, offs, mask = _row_tile(x_ptr, sxo, sxh, H, R, N, BLOCK_N, ROWS)
    tl.store(out_ptr + offs, x * tl.rsqrt(tl.sum(x * x, 1) + eps)[:, None], mask=mask)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    g = tl.load(gate_ptr + i, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, ((g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """x's rows (`rows_of`), their count, the heads and the two strides."""
    x_OHN = rows_of(x)
    return x_OHN, x_OHN.shape[0] * x_OHN.shape[1], x_OHN.shape[1], *x_OHN.stride()[:2]


def _grid(x: torch.Tensor) -> tuple[tuple[int], dict]:
    """The launch grid and shape constants for x's rows: ROWS rows a program, TILE elements at most."""
    N = x.shape[-1]
    block_n = triton.next_power_of_2(N)
    rows = max(1, TILE // block_n)
    return (triton.cdiv(x.numel() // N, rows),), {"N": N, "BLOCK_N": block_n, "ROWS": rows,
                                                  "num_warps": 8 if block_n >= 2048 else 4}


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_one_plus`'s contract; x's rows as `rows_of` takes them."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid, meta = _grid(x)
    x_OHN, R, H, sxo, sxh = _rows(x)
    _rms_kernel[grid](x_OHN, g, out, R, H, sxo, sxh, eps, **meta)
    return out


def gated_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`gated_rms_norm`'s contract (w in x's dtype); x's and z's rows as `rows_of` takes them."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid, meta = _grid(x)
    (x_OHN, R, H, sxo, sxh), (z_OHN, _, _, szo, szh) = _rows(x), _rows(z)
    _gated_kernel[grid](x_OHN, z_OHN, w, out, R, H, sxo, sxh, szo, szh, eps, **meta)
    return out


def l2norm_fp32(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`l2norm(at_least_fp32(x))` for x of at most fp32; x's rows as `rows_of` takes them."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    grid, meta = _grid(x)
    x_OHN, R, H, sxo, sxh = _rows(x)
    _l2_kernel[grid](x_OHN, out, R, H, sxo, sxh, eps, **meta)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for contiguous gate and up of one shape and dtype."""
    out = torch.empty_like(gate)
    _silu_mul_kernel[(triton.cdiv(gate.numel(), TILE),)](gate, up, out, gate.numel(), BLOCK=TILE, num_warps=8)
    return out
