"""A decode step's sampling in two Triton launches, for CUDA: the exponential race's token, the token's log-prob and
the entropy, all read from one pass over the logits [B, V] (and the race's noise).

The torch reference (reference.py) runs ~15 kernels a step over [B, V] (softmax, the race's division and argmax,
log_softmax, its exp, products and sums), each softmax and reduction one thread block per row: on an H200 at
qwen36_mini's V = 248,320 and B = 8, 0.18 ms a step, 4% of the step. Here each row is cut into chunks (a few
thread blocks per SM in all) and each chunk keeps, walking BLOCK logits at a time at temperature 1,

    m = max l,  s0 = sum exp(l - m),  s1 = sum exp(l - m) (l - m),

with the online rescaling by exp(m_old - m_new) (s1 also gains (m_old - m_new) s0), and the race's best key
l / T - log E (argmax of p / E with p = softmax(l / T): the same order, without the normaliser), first index on
ties; greedy (temperature 0) keys are the logits. A second launch merges a row's chunks the same way and writes

    token = the best key's index,  log p = l_token - M - log S0,  entropy = log S0 - S1 / S0

into the rollout's [B, R] buffers' column (strided rows). Exactness: tests/kernels/test_sampling.py (Triton's
interpreter on CPU, fp32 and fp64) and tests/kernels/test_gpu.py (CUDA) against the reference.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["race_sample_triton"]

BLOCK = 1024
# programs to aim for across the rows: a few per SM of an H100/H200 (132 SMs)
TARGET_PROGRAMS = 512
_TL_COMPUTE = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def _chunk_kernel(logits_ptr, race_ptr, part_ptr, index_ptr, V, chunk, num_chunks, stride_lb, stride_rb,
                  temperature, GREEDY: tl.constexpr, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    b, c = tl.program_id(0), tl.program_id(1)
    begin = c * chunk
    end = tl.minimum(V, begin + chunk)
    m = tl.full([], float("-inf"), COMPUTE)
    s0 = tl.full([], 0.0, COMPUTE)
    s1 = tl.full([], 0.0, COMPUTE)
    best = tl.full([], float("-inf"), COMPUTE)
    best_i = begin
    row = b.to(tl.int64) * stride_lb
    for v0 in range(begin, end, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        ok = cols < end
        l = tl.load(logits_ptr + row + cols, mask=ok, other=float("-inf")).to(COMPUTE)
        m_new = tl.maximum(m, tl.max(l, 0))
        # a chunk whose logits are all -inf so far: nothing to rescale (and no -inf - -inf)
        base = tl.where(m_new == float("-inf"), 0.0, m_new).to(COMPUTE)
        e = tl.exp(l - base)
        # m is -inf while s0 is 0: rescale from `base` itself then (no -inf * 0)
        m_old = tl.where(s0 > 0, m, base).to(COMPUTE)
        shift = (m_old - base) * s0
        alpha = tl.where(s0 > 0, tl.exp(m_old - base), 0.0).to(COMPUTE)
        s1 = alpha * (s1 + shift) + tl.sum(e * tl.where(e > 0, l - base, 0.0), 0)
        s0 = alpha * s0 + tl.sum(e, 0)
        m = m_new
        if GREEDY:
            key = l
        else:
            race = tl.load(race_ptr + b.to(tl.int64) * stride_rb + cols, mask=ok, other=1.0).to(COMPUTE)
            key = tl.where(ok, l / temperature - tl.log(tl.maximum(race, 1.1754943508222875e-38)), float("-inf"))
        top = tl.max(key, 0)
        # strictly greater: an earlier block keeps a tie (torch's argmax: the first maximal index)
        best_i = tl.where(top > best, v0 + tl.argmax(key, 0), best_i)
        best = tl.maximum(best, top)
    at = b * num_chunks + c
    tl.store(part_ptr + at, m)
    tl.store(part_ptr + num_chunks * tl.num_programs(0) + at, s0)
    tl.store(part_ptr + 2 * num_chunks * tl.num_programs(0) + at, s1)
    tl.store(part_ptr + 3 * num_chunks * tl.num_programs(0) + at, best)
    tl.store(index_ptr + at, best_i)


@triton.jit
def _merge_kernel(logits_ptr, part_ptr, index_ptr, tokens_ptr, logp_ptr, entropy_ptr, B, num_chunks, stride_lb,
                  stride_tb, stride_pb, stride_eb, BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr):
    b = tl.program_id(0)
    cs = tl.arange(0, BLOCK_C)
    ok = cs < num_chunks
    at = b * num_chunks + cs
    m_c = tl.load(part_ptr + at, mask=ok, other=float("-inf"))
    s0_c = tl.load(part_ptr + num_chunks * B + at, mask=ok, other=0.0)
    s1_c = tl.load(part_ptr + 2 * num_chunks * B + at, mask=ok, other=0.0)
    best_c = tl.load(part_ptr + 3 * num_chunks * B + at, mask=ok, other=float("-inf"))
    index_c = tl.load(index_ptr + at, mask=ok, other=0)
    M = tl.max(m_c, 0)
    base = tl.where(M == float("-inf"), 0.0, M).to(COMPUTE)
    has = s0_c > 0
    m_c = tl.where(has, m_c, base).to(COMPUTE)
    w = tl.where(has, tl.exp(m_c - base), 0.0).to(COMPUTE)
    S0 = tl.sum(w * s0_c, 0)
    S1 = tl.sum(w * (s1_c + (m_c - base) * s0_c), 0)
    # the first chunk holding the best key (chunks are in index order)
    first = tl.argmax(best_c, 0)
    token = tl.sum(tl.where(cs == first, index_c, 0), 0)
    l_token = tl.load(logits_ptr + b.to(tl.int64) * stride_lb + token).to(COMPUTE)
    log_s0 = tl.log(S0)
    tl.store(tokens_ptr + b * stride_tb, token.to(tl.int64))
    tl.store(logp_ptr + b * stride_pb, l_token - base - log_s0)
    tl.store(entropy_ptr + b * stride_eb, log_s0 - S1 / S0)


def race_sample_triton(logits_BV: torch.Tensor, race_BV: torch.Tensor | None, temperature: float,
                       tokens_B: torch.Tensor, logp_B: torch.Tensor, entropy_B: torch.Tensor,
                       chunk: int | None = None) -> None:
    """The reference's `race_sample_reference` at top_p = 1 (race_BV None: greedy), written into tokens_B (int64),
    logp_B and entropy_B (any strides). Computes in fp32, or fp64 for fp64 logits. chunk: logits a program
    reads (a multiple of BLOCK; default: about TARGET_PROGRAMS programs in all)."""
    B, V = logits_BV.shape
    assert logits_BV.stride(-1) == 1 and (race_BV is None or race_BV.shape == logits_BV.shape
                                         and race_BV.stride(-1) == 1)
    compute = torch.promote_types(logits_BV.dtype, torch.float32)
    if chunk is None:
        chunk = triton.cdiv(triton.cdiv(V, max(1, TARGET_PROGRAMS // B)), BLOCK) * BLOCK
    num_chunks = triton.cdiv(V, chunk)
    part = logits_BV.new_empty(4 * B * num_chunks, dtype=compute)
    index = logits_BV.new_empty(B * num_chunks, dtype=torch.int32)
    greedy = race_BV is None
    with torch.cuda.device_of(logits_BV) if logits_BV.is_cuda else contextlib.nullcontext():
        _chunk_kernel[(B, num_chunks)](
            logits_BV, logits_BV if greedy else race_BV, part, index, V, chunk, num_chunks, logits_BV.stride(0),
            0 if greedy else race_BV.stride(0), float(temperature) if not greedy else 1.0,
            GREEDY=greedy, BLOCK=BLOCK, COMPUTE=_TL_COMPUTE[compute], num_warps=4)
        _merge_kernel[(B,)](
            logits_BV, part, index, tokens_B, logp_B, entropy_B, B, num_chunks, logits_BV.stride(0),
            tokens_B.stride(0), logp_B.stride(0), entropy_B.stride(0),
            BLOCK_C=max(16, triton.next_power_of_2(num_chunks)), COMPUTE=_TL_COMPUTE[compute], num_warps=4)
