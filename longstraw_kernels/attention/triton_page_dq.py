"""The pages' share of dq in the replay backward, for CUDA, when the pages themselves need no gradient.

Replay differentiates the response only (`capture.gradient=response_only`): the resident pages are constants, so
of the five products of a flash backward (S = q k^T, dP = dO v^T, dV = P^T dO, dK = dS^T q, dq = dS k) the pages
need three. aten's flash backward always computes all five, and keeps [.., P, D] buffers for dk and dv. This
kernel computes dq alone (the identity of README.md, "Backward"):

    P_j = exp(scale q.k_j - L),   dS_j = P_j (dO.v_j - delta),   dq = scale sum_j dS_j k_j

with L and delta = rowsum(dO * O) of the GLOBAL out and lse. A program owns BLOCK_M folded query rows of one kv
head (queries of the G heads and the batch folded into rows, as the forward does) and walks a range of pages
BLOCK_N at a time, its [BLOCK_M, D] dq accumulator in fp32 registers; the pages are read in place ([P, K, D]
strides, no transpose or copy). When rows x heads make too few programs for the GPU, the pages are split into
ranges whose partial dq are summed afterwards in a fixed order (deterministic, no atomics).

Precision: bf16/fp16 operands, fp32 accumulation (dS is rounded to the operand dtype for the last product, as in
flash attention's backward); dq comes back in fp32. Checked against the fp64 reference by tests/kernels/test_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["DEFAULT_CONFIG", "DqConfig", "page_dq", "row_block", "rows_against_pages"]

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DqConfig:
    block_m: int  # folded query rows per program
    block_n: int  # pages per loop step
    num_warps: int
    num_stages: int


# 128 rows, 64 pages, 8 warps, one stage: on one H200 at qwen36_mini's shape (R = 1,024, 1M pages,
# bench_replay_backward.py --sweep) 57.4 ms, 460 TFLOP/s of the three products; (128, 32, 8, 2) 64.2 ms, (64, 64, 4, 2)
# 68.6 ms, the first choice (64, 64, 8, 2) 110.2 ms, others 99-213 ms; (128, 64, 8, 2) and (64, 128, 8, 2) exceed
# the 227 KiB of shared memory.
DEFAULT_CONFIG = DqConfig(128, 64, 8, 1)


@triton.jit
def row_block(q_ptr, do_ptr, lse_ptr, delta_ptr, M, stride_qk, stride_qm, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's block of folded query rows (axis 0) of kv head `head` (axis 1): (head, rows, row_ok, cols, q, dO,
    lse in log2 units, delta). Masked rows: lse = delta = 0 and dO = 0, so their dS is 0."""
    pid_m, head = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, D)
    q_off = head.to(tl.int64) * stride_qk + rows[:, None].to(tl.int64) * stride_qm + cols[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + q_off, mask=row_ok[:, None], other=0.0)
    lse_log2 = tl.load(lse_ptr + head * M + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + head * M + rows, mask=row_ok, other=0.0)
    return head, rows, row_ok, cols, q, do, lse_log2, delta


@triton.jit
def _page_dq_kernel(q_ptr, do_ptr, lse_ptr, delta_ptr, k_ptr, v_ptr, dq_ptr, M, P, pages_per_split,
                    stride_qk, stride_qm, stride_kp, stride_kk, stride_dqs, stride_dqk, stride_dqm,
                    scale, scale_log2e,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    split = tl.program_id(2)
    head, rows, row_ok, cols, q, do, lse_log2, delta = row_block(q_ptr, do_ptr, lse_ptr, delta_ptr, M, stride_qk,
                                                                  stride_qm, D, BLOCK_M)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    p_begin = split * pages_per_split
    p_end = tl.minimum(P, p_begin + pages_per_split)
    for p0 in range(p_begin, p_end, BLOCK_N):
        pages = p0 + tl.arange(0, BLOCK_N)
        page_ok = pages < p_end
        kv_off = pages[:, None].to(tl.int64) * stride_kp + head.to(tl.int64) * stride_kk + cols[None, :]
        k = tl.load(k_ptr + kv_off, mask=page_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=page_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        p = tl.exp2(s * scale_log2e - lse_log2[:, None])
        p = tl.where(page_ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        acc = tl.dot(ds.to(k.dtype), k, acc)
    dq_off = (split.to(tl.int64) * stride_dqs + head.to(tl.int64) * stride_dqk
              + rows[:, None].to(tl.int64) * stride_dqm + cols[None, :])
    tl.store(dq_ptr + dq_off, acc * scale, mask=row_ok[:, None])


def _splits(programs: int, pages: int, block_n: int, device: torch.device) -> int:
    """Page ranges per (row block, head): enough programs for two per SM, at most 8, each >= 16 page blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, min(8, -(-2 * sms // programs)))
    return max(1, min(want, pages // (16 * block_n)))


def rows_against_pages(q_KMD, do_KMD, lse_KM, delta_KM, k_pages_PKD, v_pages_PKD):
    """The kernels' row operands as they read them (q, dO contiguous; lse, delta fp32 contiguous), after checking
    them against the pages [P, K, D] (k and v laid out alike, contiguous in D)."""
    K, M, D = q_KMD.shape
    P = k_pages_PKD.shape[0]
    assert k_pages_PKD.shape == v_pages_PKD.shape == (P, K, D) and do_KMD.shape == q_KMD.shape
    assert k_pages_PKD.stride() == v_pages_PKD.stride() and k_pages_PKD.stride(2) == 1
    return q_KMD.contiguous(), do_KMD.contiguous(), lse_KM.float().contiguous(), delta_KM.float().contiguous()


def page_dq(q_KMD: torch.Tensor, do_KMD: torch.Tensor, lse_KM: torch.Tensor, delta_KM: torch.Tensor,
            k_pages_PKD: torch.Tensor, v_pages_PKD: torch.Tensor, scale: float,
            config: DqConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """dq_KMD (fp32) of folded query rows q_KMD against the pages, given each row's dO, global lse and delta."""
    q_KMD, do_KMD, lse_KM, delta_KM = rows_against_pages(q_KMD, do_KMD, lse_KM, delta_KM, k_pages_PKD, v_pages_PKD)
    K, M, D = q_KMD.shape
    P = k_pages_PKD.shape[0]
    row_blocks = triton.cdiv(M, config.block_m)
    splits = _splits(row_blocks * K, P, config.block_n, q_KMD.device)
    pages_per_split = triton.cdiv(triton.cdiv(P, splits), config.block_n) * config.block_n
    splits = triton.cdiv(P, pages_per_split) if P else 1
    dq_SKMD = torch.zeros(splits, K, M, D, dtype=torch.float32, device=q_KMD.device)
    if P:
        _page_dq_kernel[(row_blocks, K, splits)](
            q_KMD, do_KMD, lse_KM, delta_KM, k_pages_PKD, v_pages_PKD, dq_SKMD, M, P, pages_per_split,
            q_KMD.stride(0), q_KMD.stride(1), k_pages_PKD.stride(0), k_pages_PKD.stride(1),
            dq_SKMD.stride(0), dq_SKMD.stride(1), dq_SKMD.stride(2), scale, scale * LOG2E,
            D=D, BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
            num_stages=config.num_stages)
    return dq_SKMD[0] if splits == 1 else dq_SKMD.sum(0)
