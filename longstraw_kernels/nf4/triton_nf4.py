"""NF4 dequantisation in Triton: one pass from the 4-bit codes to W in its dtype.

`dequantize_triton(parts)` reads half a byte a weight (plus a scaler byte per 64) and writes each weight once;
torchao's `get_original_weight` runs a dozen torch ops through int64 and full-size intermediates (17x the time
for the 27B shape's linears on an H200, docs/BENCHMARKS.md). It reproduces `reference.dequantize_reference`
bit for bit: every step computes in fp32 and rounds to W's dtype as torch does (the scaler's division with
`div_rn`, IEEE-rounded, as torch divides).

Layout: W.flat[i] is code i of `codes` (byte i // 2; high nibble for even i), absmax block i // 64. A 64-block
is 32 bytes. A program takes DEQUANT_BLOCKS blocks.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from longstraw_kernels.nf4.reference import BLOCK, NF4Parts

# 64-blocks per program and warps (Triton's default 4): 2.78 TB/s for the 27B shape's linears on an H200
# (bench_nf4.py; the only configuration timed so far)
DEQUANT_BLOCKS, DEQUANT_WARPS = 32, 4

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round(x, OUT: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 x rounded to OUT (to nearest, ties to even), still fp32. Triton's interpreter truncates fp32 to bf16,
    so there bf16 rounds on the bits (the same numbers for finite x)."""
    if INTERPRETED and OUT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(OUT).to(tl.float32)


@triton.jit
def _absmax(scalers_ptr, factors_ptr, mean, block, scaler_block, mask, OUT: tl.constexpr, INTERPRETED: tl.constexpr):
    """The absmax of 64-blocks `block` (any shape), rounded as the reference rounds, in fp32."""
    quantised = tl.load(scalers_ptr + block, mask=mask, other=0).to(tl.float32)
    factor = tl.load(factors_ptr + block // scaler_block, mask=mask, other=1.0).to(tl.float32)
    scaled = _round(tl.math.div_rn(quantised, factor), OUT, INTERPRETED)
    return _round(scaled + mean, OUT, INTERPRETED)


@triton.jit
def _dequantize_kernel(codes_ptr, scalers_ptr, factors_ptr, mean_ptr, table_ptr, out_ptr, n_blocks, scaler_block,
                       OUT: tl.constexpr, INTERPRETED: tl.constexpr, BLOCKS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    valid = block < n_blocks
    mean = tl.load(mean_ptr).to(tl.float32)
    absmax = _absmax(scalers_ptr, factors_ptr, mean, block, scaler_block, valid, OUT, INTERPRETED)
    byte = block[:, None] * 32 + tl.arange(0, 32)[None, :]
    code = tl.load(codes_ptr + byte, mask=valid[:, None], other=0).to(tl.int32)
    high = _round(tl.load(table_ptr + (code >> 4)).to(tl.float32) * absmax[:, None], OUT, INTERPRETED).to(OUT)
    low = _round(tl.load(table_ptr + (code & 0xF)).to(tl.float32) * absmax[:, None], OUT, INTERPRETED).to(OUT)
    # [BLOCKS, 32, 2] -> [BLOCKS, 64]: the even weight of each byte first
    weights = tl.reshape(tl.join(high, low), (BLOCKS, 64))
    element = block[:, None] * 64 + tl.arange(0, 64)[None, :]
    tl.store(out_ptr + element, weights, mask=valid[:, None])


def dequantize_triton(p: NF4Parts, config: tuple[int, int] = (DEQUANT_BLOCKS, DEQUANT_WARPS)) -> torch.Tensor:
    """W [N, K] in p.dtype (CUDA; p.dtype bf16, fp16 or fp32). `config`: (64-blocks a program, warps), for
    sweeps (scripts/bench/bench_nf4.py --sweep)."""
    blocks, warps = config
    n, k = p.shape
    out = torch.empty(n, k, dtype=p.dtype, device=p.codes.device)
    n_blocks = n * k // BLOCK
    _dequantize_kernel[(triton.cdiv(n_blocks, blocks),)](
        p.codes, p.scalers, p.factors, p.mean, p.table, out, n_blocks, p.scaler_block,
        OUT=_TL_DTYPE[p.dtype], INTERPRETED=_interpreted(), BLOCKS=blocks, num_warps=warps)
    return out


def _interpreted() -> bool:
    """Under Triton's interpreter (TRITON_INTERPRET=1: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
