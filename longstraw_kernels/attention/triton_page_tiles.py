"""The prompt pages' whole attention backward (all five products) where the pages need gradients (exact mode's
walk), for CUDA: three products in one Triton launch a chunk of pages, two as cuBLAS GEMMs. The replay backward's
path for such pages (flash.py) wherever the head dim is a power of two.

triton_page_dq.py computes three of the five products (S = q k^T, dP = dO v^T, dq = dS k) at 460 TFLOP/s on an H200
at head dim 256; the other two, dV = P^T dO and dK = dS^T q, reduce over the query rows, which a kernel that owns
rows cannot do without atomics. Here, per chunk of `chunk` pages (the identity of README.md, "Backward"):

    launch   P = exp(scale q k^T - L) and dS = P (dO v^T - delta), stored as [K, M, chunk] tiles in the operand
             dtype (flash attention's backward rounds them so for the same products), and dq += scale dS k in fp32
             (page_dq's loop, the tiles written on the way)
    GEMMs    dV = P^T dO, dK = scale dS^T q (cuBLAS, batched over the kv heads)

with L and delta = rowsum(dO * O) of the GLOBAL out and lse. The tiles are the only temporaries: 2 K M chunk
elements, never page-sized. Rows are a kv head's folded query rows ([K, M, D], as the forward folds them).

Exactness: tests/kernels/test_page_tiles.py (Triton's interpreter on CPU, fp32, against the fp64 products) and
tests/kernels/test_gpu.py (bf16 on CUDA against the fp64 reference, through the replay attention).
Speed (docs/BENCHMARKS.md, one H100): qwen36_mini's exact walk at 256K 35.47 / 35.67 s against 37.34 / 36.96 s with
cuDNN's backward over page chunks, in `longstraw train`; alone at 4,096 queries x 262,144 pages 107.27 ms (410 TFLOP/s)
against cuDNN's 119.12 ms (369), with 2.67 GiB of extra peak against its 1.00.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw_kernels.attention.triton_page_dq import LOG2E, DqConfig, row_block, rows_against_pages

__all__ = ["DEFAULT_CHUNK", "DEFAULT_CONFIG", "page_backward"]

# page_dq's tiles (128 rows, 64 pages, 8 warps, one stage: its best on an H200 at head dim 256); here too the best of
# three on an H100 at 2,048 pages a chunk (341 TFLOP/s; 128, 32, 8, 2: 286; 64, 64, 4, 2: 248)
DEFAULT_CONFIG = DqConfig(128, 64, 8, 1)
# pages a chunk: the tiles are 2 K M chunk elements (qwen36_mini's walk, M = 32,768 folded rows, K = 2: 2 GiB in
# bf16). On one H100 at 262,144 pages: 2,048 pages 341 TFLOP/s, 4,096 389, 8,192 406 (bench_pages_backward.py)
DEFAULT_CHUNK = 8192


@triton.jit
def _tiles_kernel(q_ptr, do_ptr, lse_ptr, delta_ptr, k_ptr, v_ptr, dq_ptr, p_ptr, ds_ptr, M, N, page0,
                  stride_qk, stride_qm, stride_kp, stride_kk, stride_tk, stride_tm, scale, scale_log2e,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head, rows, row_ok, cols, q, do, lse_log2, delta = row_block(q_ptr, do_ptr, lse_ptr, delta_ptr, M, stride_qk,
                                                                  stride_qm, D, BLOCK_M)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    t_rows = head.to(tl.int64) * stride_tk + rows[:, None].to(tl.int64) * stride_tm
    for n0 in range(0, N, BLOCK_N):
        local = n0 + tl.arange(0, BLOCK_N)
        page_ok = local < N
        kv_off = (page0 + local)[:, None].to(tl.int64) * stride_kp + head.to(tl.int64) * stride_kk + cols[None, :]
        k = tl.load(k_ptr + kv_off, mask=page_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=page_ok[:, None], other=0.0)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2e - lse_log2[:, None])
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        p_t = p.to(p_ptr.dtype.element_ty)
        ds_t = ds.to(ds_ptr.dtype.element_ty)
        t_mask = row_ok[:, None] & page_ok[None, :]
        tl.store(p_ptr + t_rows + local[None, :], p_t, mask=t_mask)
        tl.store(ds_ptr + t_rows + local[None, :], ds_t, mask=t_mask)
        acc = tl.dot(ds_t.to(k.dtype), k, acc)
    dq_off = head.to(tl.int64) * M * D + rows[:, None].to(tl.int64) * D + cols[None, :]
    dq = tl.load(dq_ptr + dq_off, mask=row_ok[:, None], other=0.0)
    tl.store(dq_ptr + dq_off, dq + acc * scale, mask=row_ok[:, None])


def _scaled_bmm(a, b, scale: float):
    """scale * a @ b, rounded once to a's dtype (cuBLAS's alpha on CUDA)."""
    return torch.baddbmm(a.new_empty(a.shape[0], a.shape[1], b.shape[2]), a, b, beta=0.0, alpha=scale)


def page_backward(q_KMD: torch.Tensor, do_KMD: torch.Tensor, lse_KM: torch.Tensor, delta_KM: torch.Tensor,
                  k_pages_PKD: torch.Tensor, v_pages_PKD: torch.Tensor, scale: float, chunk: int | None = None,
                  config: DqConfig = DEFAULT_CONFIG):
    """-> (dq_KMD fp32, dk_pages_PKD, dv_pages_PKD in the pages' dtype) of folded query rows against every page, given
    each row's dO, global lse and delta; `chunk` pages at a time (None: DEFAULT_CHUNK)."""
    q_KMD, do_KMD, lse_KM, delta_KM = rows_against_pages(q_KMD, do_KMD, lse_KM, delta_KM, k_pages_PKD, v_pages_PKD)
    K, M, D = q_KMD.shape
    P = k_pages_PKD.shape[0]
    dq_KMD = torch.zeros(K, M, D, dtype=torch.float32, device=q_KMD.device)
    dk_PKD, dv_PKD = torch.empty_like(k_pages_PKD), torch.empty_like(v_pages_PKD)
    if P == 0:
        return dq_KMD, dk_PKD, dv_PKD
    size = min(DEFAULT_CHUNK if chunk is None else chunk, P)
    p_KMN = q_KMD.new_empty(K, M, size)
    ds_KMN = q_KMD.new_empty(K, M, size)
    with torch.cuda.device_of(q_KMD):
        for p0 in range(0, P, size):
            n = min(size, P - p0)
            p_tiles, ds_tiles = p_KMN[..., :n], ds_KMN[..., :n]
            _tiles_kernel[(triton.cdiv(M, config.block_m), K)](
                q_KMD, do_KMD, lse_KM, delta_KM, k_pages_PKD, v_pages_PKD, dq_KMD, p_tiles, ds_tiles, M, n, p0,
                q_KMD.stride(0), q_KMD.stride(1), k_pages_PKD.stride(0), k_pages_PKD.stride(1), p_tiles.stride(0),
                p_tiles.stride(1), scale, scale * LOG2E, D=D, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                num_warps=config.num_warps, num_stages=config.num_stages)
            # [K, n, M] @ [K, M, D]: the reductions over the rows
            dv_PKD[p0 : p0 + n] = torch.bmm(p_tiles.transpose(1, 2), do_KMD).transpose(0, 1)
            dk_PKD[p0 : p0 + n] = _scaled_bmm(ds_tiles.transpose(1, 2), q_KMD, scale).transpose(0, 1)
    return dq_KMD, dk_PKD, dv_PKD
