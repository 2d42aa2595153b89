"""qwen36's norms and its MLP gate, each one Triton launch forward and one backward.

In eager torch each of these is a chain of kernels over fp32 copies of the rows: `rms_norm_one_plus` is seven
passes over an [T, C] tensor (the fp32 copy, pow, mean, two products, the cast), and the gated norm, the L2 norm
and SiLU(gate) * up the same. A launch here reads its inputs once and writes its output once, with the reference's
roundings:

    rms_norm       (x rsqrt(mean(x^2) + eps)) (1 + g), fp32, rounded to x's dtype    (linear/reference.py)
    gated_norm     w round(x rsqrt(mean(x^2) + eps)), rounded; times silu(z) fp32, rounded  (linear/reference.py)
    l2norm_fp32    x rsqrt(sum(x^2) + eps) in fp32, kept fp32                          (gdn/reference.py `l2norm`)
    silu_mul       round(silu(gate)) up, rounded                                       (linear/reference.py)

Where an input requires grad (autograd on: replay, the exact walk) each entry records an autograd Function that
saves its inputs alone and, backward, recomputes a row's norm from x and writes every input's gradient in one launch,
in fp32, rounded once to the input's dtype; a weight's gradient is summed over the rows by at most PARTS programs and
their partial sums added by torch, in a fixed order. The references' graphs keep fp32 copies of the rows and run a
chain of kernels back, rounding some products to the activations' dtype on the way.

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

from longstraw_kernels import needs_grad

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
    """This program's rows of x: `_row_block`'s block of the program's index."""
    return _row_block(x_ptr, stride_o, stride_h, H, R, tl.program_id(0), N, BLOCK_N, ROWS)


@triton.jit
def _row_block(x_ptr, stride_o, stride_h, H, R, block, N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Block `block` of ROWS rows of x ([R // H, H, N], strided) as fp32 [ROWS, BLOCK_N] (zeros outside), their
    offsets in a contiguous [R, N] output and the mask."""
    r = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
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
    y = x * tl.rsqrt(tl.sum(x * x, 1) / N + eps)[:, None] * (1.0 + g)[None, :]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


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


# the backward kernels: each recomputes its row's norm from x (nothing but the inputs is saved), in fp32, and
# rounds each gradient once to its input's dtype; a weight's gradient is summed over rows in fp32 by a fixed set of
# programs (PARTS at most, each its blocks in order), whose partial sums torch adds: the same bits every run

@triton.jit
def _rms_input_grad(a, h, rstd, N: tl.constexpr):
    """RMSNorm's gradient at x from a = dL/dh and h = x rstd (rows of [ROWS, BLOCK_N], fp32, mean over N):
    rstd (a - h mean(a h))."""
    return rstd[:, None] * (a - h * (tl.sum(a * h, 1) / N)[:, None])


@triton.jit
def _rms_bwd_kernel(x_ptr, g_ptr, dy_ptr, dx_ptr, dg_ptr, R, H, sxo, sxh, eps, blocks, WANT_DG: tl.constexpr,
                    N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    dtype = dx_ptr.dtype.element_ty
    n = tl.arange(0, BLOCK_N)
    scale = 1.0 + tl.load(g_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    dg = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
        x, offs, mask = _row_block(x_ptr, sxo, sxh, H, R, block, N, BLOCK_N, ROWS)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
        h = x * rstd[:, None]
        if WANT_DG:  # y = h (1 + g)
            dg += tl.sum(dy * h, 0)
        tl.store(dx_ptr + offs, _rms_input_grad(dy * scale[None, :], h, rstd, N).to(dtype), mask=mask)
    if WANT_DG:
        tl.store(dg_ptr + tl.program_id(0) * BLOCK_N + n, dg)


@triton.jit
def _gated_bwd_kernel(x_ptr, z_ptr, w_ptr, dy_ptr, dx_ptr, dz_ptr, dw_ptr, R, H, sxo, sxh, szo, szh, eps, blocks,
                      WANT_DW: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    dtype = dx_ptr.dtype.element_ty
    n = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
        x, offs, mask = _row_block(x_ptr, sxo, sxh, H, R, block, N, BLOCK_N, ROWS)
        z, _, _ = _row_block(z_ptr, szo, szh, H, R, block, N, BLOCK_N, ROWS)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
        xr = x * rstd[:, None]
        h = xr.to(dtype).to(tl.float32)
        u = (w[None, :] * h).to(dtype).to(tl.float32)
        s = tl.sigmoid(z)
        du = dy * (z * s)  # y = round(w round(h)) silu(z)
        tl.store(dz_ptr + offs, (dy * u * s * (1.0 + z * (1.0 - s))).to(dtype), mask=mask)
        if WANT_DW:
            dw += tl.sum(du * h, 0)
        tl.store(dx_ptr + offs, _rms_input_grad(du * w[None, :], xr, rstd, N).to(dtype), mask=mask)
    if WANT_DW:
        tl.store(dw_ptr + tl.program_id(0) * BLOCK_N + n, dw)


@triton.jit
def _l2_bwd_kernel(x_ptr, dy_ptr, dx_ptr, R, H, sxo, sxh, eps, N: tl.constexpr, BLOCK_N: tl.constexpr,
                   ROWS: tl.constexpr):
    x, offs, mask = _row_tile(x_ptr, sxo, sxh, H, R, N, BLOCK_N, ROWS)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) + eps)
    # the L2 norm is RMSNorm with the sum in place of the mean: its gradient with N = 1
    dx = _rms_input_grad(dy, x * rstd[:, None], rstd, 1)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(gate_ptr, up_ptr, dy_ptr, dgate_ptr, dup_ptr, numel, BLOCK: tl.constexpr):
    dtype = dgate_ptr.dtype.element_ty
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    g = tl.load(gate_ptr + i, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + i, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + i, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dup_ptr + i, (dy * (g * s).to(dtype).to(tl.float32)).to(dtype), mask=mask)
    tl.store(dgate_ptr + i, (dy * u * s * (1.0 + g * (1.0 - s))).to(dtype), mask=mask)


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


def _rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid, meta = _grid(x)
    x_OHN, R, H, sxo, sxh = _rows(x)
    _rms_kernel[grid](x_OHN, g, out, R, H, sxo, sxh, eps, **meta)
    return out


def _gated_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid, meta = _grid(x)
    (x_OHN, R, H, sxo, sxh), (z_OHN, _, _, szo, szh) = _rows(x), _rows(z)
    _gated_kernel[grid](x_OHN, z_OHN, w, out, R, H, sxo, sxh, szo, szh, eps, **meta)
    return out


def _l2norm_fp32(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    grid, meta = _grid(x)
    x_OHN, R, H, sxo, sxh = _rows(x)
    _l2_kernel[grid](x_OHN, out, R, H, sxo, sxh, eps, **meta)
    return out


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    _silu_mul_kernel[(triton.cdiv(gate.numel(), TILE),)](gate, up, out, gate.numel(), BLOCK=TILE, num_warps=8)
    return out


# a weight's gradient: at most this many programs sum its rows, each a partial sum torch adds
PARTS = 512


def _weight_grid(x: torch.Tensor, want: bool) -> tuple[tuple[int], int, dict]:
    """The backward's grid where a weight's gradient is summed over x's rows (`want`: PARTS programs at most, each
    walking its blocks), the blocks of rows and `_grid`'s constants."""
    grid, meta = _grid(x)
    return (min(grid[0], PARTS) if want else grid[0],), grid[0], meta


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, eps):
        ctx.save_for_backward(x, g)
        ctx.eps = eps
        return _rms_norm(x, g, eps)

    @staticmethod
    def backward(ctx, dy):
        x, g = ctx.saved_tensors
        want_dg = ctx.needs_input_grad[1]
        grid, blocks, meta = _weight_grid(x, want_dg)
        x_OHN, R, H, sxo, sxh = _rows(x)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dg = torch.empty(grid[0], meta["BLOCK_N"], dtype=torch.float32, device=x.device) if want_dg else dx
        _rms_bwd_kernel[grid](x_OHN, g, dy.contiguous(), dx, dg, R, H, sxo, sxh, ctx.eps, blocks,
                              WANT_DG=want_dg, **meta)
        return dx, (dg.sum(0)[: g.shape[0]].to(g.dtype) if want_dg else None), None


class _GatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, w, eps):
        ctx.save_for_backward(x, z, w)
        ctx.eps = eps
        return _gated_norm(x, z, w, eps)

    @staticmethod
    def backward(ctx, dy):
        x, z, w = ctx.saved_tensors
        want_dw = ctx.needs_input_grad[2]
        grid, blocks, meta = _weight_grid(x, want_dw)
        (x_OHN, R, H, sxo, sxh), (z_OHN, _, _, szo, szh) = _rows(x), _rows(z)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dz = torch.empty(x.shape, dtype=z.dtype, device=x.device)
        dw = torch.empty(grid[0], meta["BLOCK_N"], dtype=torch.float32, device=x.device) if want_dw else dx
        _gated_bwd_kernel[grid](x_OHN, z_OHN, w, dy.contiguous(), dx, dz, dw, R, H, sxo, sxh, szo, szh,
                                ctx.eps, blocks, WANT_DW=want_dw, **meta)
        return dx, dz, (dw.sum(0)[: w.shape[0]].to(w.dtype) if want_dw else None), None


class _L2Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        ctx.save_for_backward(x)
        ctx.eps = eps
        return _l2norm_fp32(x, eps)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        grid, meta = _grid(x)
        x_OHN, R, H, sxo, sxh = _rows(x)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _l2_bwd_kernel[grid](x_OHN, dy.contiguous(), dx, R, H, sxo, sxh, ctx.eps, **meta)
        return dx, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _silu_mul(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _silu_mul_bwd_kernel[(triton.cdiv(gate.numel(), TILE),)](gate, up, dy.contiguous(), dgate, dup,
                                                                 gate.numel(), BLOCK=TILE, num_warps=8)
        return dgate, dup


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_one_plus`'s contract; x's rows as `rows_of` takes them. Where an input requires grad (autograd on)
    the call records its backward kernel."""
    return _RMSNorm.apply(x, g, eps) if needs_grad(x, g) else _rms_norm(x, g, eps)


def gated_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`gated_rms_norm`'s contract (w in x's dtype); x's and z's rows as `rows_of` takes them; a graph as
    `rms_norm`."""
    return _GatedNorm.apply(x, z, w, eps) if needs_grad(x, z, w) else _gated_norm(x, z, w, eps)


def l2norm_fp32(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`l2norm(at_least_fp32(x))` for x of at most fp32; x's rows as `rows_of` takes them; a graph as `rms_norm`."""
    return _L2Norm.apply(x, eps) if needs_grad(x) else _l2norm_fp32(x, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for contiguous gate and up of one shape and dtype; a graph as `rms_norm`."""
    return _SiluMul.apply(gate, up) if needs_grad(gate, up) else _silu_mul(gate, up)
