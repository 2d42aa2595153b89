"""Decode attention from shared prompt pages (cascade attention): one query token per response.

A decode step of G responses that share one prompt reads the prompt's pages ONCE for all of them: every
response and every query head of a kv group become rows of one query block against the pages (no mask: each
response sees the whole prompt), as in FlashInfer's cascade attention and Hydragen. Each response's own keys
(its generated tokens: the first `filled` slots of a preallocated buffer) are attended separately, and the two
parts merge by log-sum-exp. On CUDA the response part is a Triton kernel that reads only the filled slots, in
place (triton_decode_response.py); elsewhere the reference upcasts and masks the whole buffer.

With few kv heads and a few dozen query rows, one attention call over the pages would run on a handful of
thread blocks: the pages are cut into `num_splits` pieces that become the batch axis of the kernel (split-KV,
"flash decoding"), and the pieces merge by log-sum-exp. On CUDA in bf16/fp16 each piece runs aten's flash
attention forward; elsewhere a plain torch softmax (the reference). Shapes are static for a given prompt and
response capacity, so the whole step can be replayed as a CUDA graph.

Legend: B responses, Q query heads, K kv heads, G = Q // K, M = B * G query rows of a kv group, P pages,
N pages of one split, S response-key capacity, D head dim.
"""

from __future__ import annotations

import torch

from longstraw_kernels import compute_dtype, kernel_choice, optional_module, say_once
from longstraw_kernels.attention.flash import FLASH_DTYPES

__all__ = ["decode_pages_attention", "response_partials", "merge_partials", "cascade_decode_attention",
           "say_where_the_references_run"]

# thread blocks to aim for in one pages call. Fewer than an H200's 132 SMs: each block streams its range at the
# bandwidth, and every split is a partial to write and merge. qwen36_mini's layer (262,144 pages, 2 kv heads, 64
# rows), one CUDA graph of the compiled call on an H200: 256 splits (a target of 512) 0.183 ms, 128 0.149, 64 0.156,
# 32 0.147, 16 0.153 (scripts/bench/bench_decode_pages.py; docs/BENCHMARKS.md)
TARGET_BLOCKS = 64
MIN_SPLIT = 1024


def merge_partials(out_NXD: torch.Tensor, lse_NX: torch.Tensor, dtype: torch.dtype | None = None):
    """LSE merge of N partials over disjoint keys (dim 0). -> (out_XD in `dtype` or out's, lse_X float32+).
    A row whose partials are all empty (lse -inf) comes out 0 with lse -inf."""
    lse_X = torch.logsumexp(lse_NX, dim=0)
    finite_X = torch.isfinite(lse_X)
    weight_NX = torch.exp(lse_NX - torch.where(finite_X, lse_X, 0.0)[None]).nan_to_num_(0.0)
    merged_XD = (weight_NX[..., None] * out_NXD.to(weight_NX.dtype)).sum(0)
    return merged_XD.to(dtype or out_NXD.dtype), lse_X


def _attend_torch(q_HMD, k_HND, v_HND, scale: float):
    """softmax(scale q k^T) v and its row lse over one set of keys, in fp32 (fp64 stays fp64)."""
    dtype = compute_dtype(q_HMD.dtype)
    scores_HMN = (q_HMD.to(dtype) @ k_HND.to(dtype).transpose(-1, -2)) * scale
    lse_HM = torch.logsumexp(scores_HMN, dim=-1)
    out_HMD = torch.exp(scores_HMN - lse_HM[..., None]) @ v_HND.to(dtype)
    return out_HMD, lse_HM


def _attend_flash(q_HMD, k_HND, v_HND, scale: float):
    out = torch.ops.aten._scaled_dot_product_flash_attention(q_HMD[None], k_HND[None], v_HND[None], 0.0, False,
                                                             False, scale=scale)
    return out[0][0], out[1][0]


def _splits(num_pages: int, num_kv: int) -> int:
    return max(1, min(TARGET_BLOCKS // max(num_kv, 1), num_pages // MIN_SPLIT))


def decode_pages_attention(q_BQD: torch.Tensor, k_pages_PKD: torch.Tensor, v_pages_PKD: torch.Tensor, *,
                           scale: float, num_splits: int | None = None):
    """One query token per response against all shared pages. -> (out_BQD in q's dtype, lse_BQ float32+).
    With no pages the partial is empty: out 0, lse -inf. The rows of kv head k are its group's query heads of every
    response, m = b * G + g. On the flash path the pages are a batch of equal ranges, which flash may split again,
    and a call for the rest (one varlen call over the ranges measured no faster on an H200: 0.156 ms at best against
    the batch's 0.156, docs/BENCHMARKS.md 2026-12-05); the ranges' partials merge by log-sum-exp."""
    B, Q, D = q_BQD.shape
    P, K = k_pages_PKD.shape[:2]
    G = Q // K
    if P == 0:
        return (q_BQD.new_zeros(B, Q, D), q_BQD.new_full((B, Q), float("-inf"), dtype=compute_dtype(q_BQD.dtype)))
    flash = _pages_flash(q_BQD.is_cuda, q_BQD.dtype, k_pages_PKD.dtype, D)
    attend = _attend_flash if flash else _attend_torch
    # [B, K*G, D] -> [K, B*G, D]: responses and a group's query heads are rows against the group's kv head
    q_KMD = q_BQD.reshape(B, K, G, D).transpose(0, 1).reshape(K, B * G, D)
    splits = num_splits or _splits(P, K)
    size = P // splits
    outs, lses = [], []
    if size > 0:
        body = size * splits
        # [splits*N, K, D] -> [splits*K, N, D] views: each split is a batch entry of one kernel call
        k_SKND = k_pages_PKD[:body].view(splits, size, K, D).transpose(1, 2)
        v_SKND = v_pages_PKD[:body].view(splits, size, K, D).transpose(1, 2)
        q_SKMD = q_KMD[None].expand(splits, -1, -1, -1)
        if flash:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q_SKMD.contiguous(), k_SKND, v_SKND, 0.0,
                                                                     False, False, scale=scale)
            out_SKMD, lse_SKM = out[0], out[1]
        else:
            out_SKMD, lse_SKM = _attend_torch(q_SKMD, k_SKND, v_SKND, scale)
        outs.append(out_SKMD)
        lses.append(lse_SKM)
    if size * splits < P:
        tail_k_KND = k_pages_PKD[size * splits :].transpose(0, 1)
        tail_v_KND = v_pages_PKD[size * splits :].transpose(0, 1)
        out_KMD, lse_KM = attend(q_KMD, tail_k_KND, tail_v_KND, scale)
        outs.append(out_KMD[None])
        lses.append(lse_KM[None])
    lse_NKM = torch.cat(lses).to(compute_dtype(q_BQD.dtype))
    out_KMD, lse_KM = merge_partials(torch.cat(outs).to(lse_NKM.dtype), lse_NKM, q_BQD.dtype)
    return _rows_back(out_KMD, lse_KM, B, G)


def _rows_back(out_KMD: torch.Tensor, lse_KM: torch.Tensor, B: int, G: int):
    """[K, B * G, D] rows of the kv groups back to (out [B, Q, D], lse [B, Q])."""
    K, _, D = out_KMD.shape
    out_BQD = out_KMD.reshape(K, B, G, D).transpose(0, 1).reshape(B, K * G, D)
    lse_BQ = lse_KM.reshape(K, B, G).transpose(0, 1).reshape(B, K * G)
    return out_BQD, lse_BQ


def _pages_flash(is_cuda: bool, dtype: torch.dtype, page_dtype: torch.dtype, head_dim: int) -> bool:
    """Flash attention reads the pages (CUDA, queries and pages in one flash dtype, a head dim of at most 256)."""
    return is_cuda and dtype in FLASH_DTYPES and page_dtype == dtype and head_dim <= 256


def _response_serves(is_cuda: bool, dtype: torch.dtype, slot_dtype: torch.dtype, head_dim: int) -> bool:
    """The Triton kernel can read the response slots (as `_pages_flash`, and a power-of-two head dim)."""
    return _pages_flash(is_cuda, dtype, slot_dtype, head_dim) and head_dim & (head_dim - 1) == 0


def _response_triton(q_BQD: torch.Tensor, k_BSKD: torch.Tensor) -> bool:
    """The Triton kernel reads the response slots (`_response_serves`, kernels.decode_attention=auto, rows in place,
    Triton imports)."""
    return (kernel_choice("decode_attention") == "auto" and k_BSKD.stride(-1) == 1
            and _response_serves(q_BQD.is_cuda, q_BQD.dtype, k_BSKD.dtype, q_BQD.shape[-1])
            and _response_kernel_imports())


def say_where_the_references_run(device: torch.device, dtype: torch.dtype, page_dtype: torch.dtype,
                                 head_dim: int) -> None:
    """A decoder's line, once, on CUDA, for each part of this attention that its torch reference will run for
    these operands (queries in `dtype`, pages and response slots in `page_dtype`): fp32 runs, say, or a head dim
    above 256. Off CUDA the references are the path and nothing is said; under kernels.decode_attention=torch the
    run asked for them."""
    if device.type != "cuda":
        return
    if not _pages_flash(True, dtype, page_dtype, head_dim):
        say_once(f"decode: flash attention does not take the pages here (queries {dtype}, pages {page_dtype}, head "
                 f"dim {head_dim}; it needs bf16/fp16 alike and a head dim of at most 256): the torch reference "
                 "reads them, upcast, at every step")
    if kernel_choice("decode_attention") == "auto" and not (_response_serves(True, dtype, page_dtype, head_dim)
                                                             and _response_kernel_imports()):
        say_once(f"decode: the response attention kernel does not serve here (queries {dtype}, slots {page_dtype}, "
                 f"head dim {head_dim}; it needs Triton, bf16/fp16 alike and a power-of-two head dim of at most "
                 "256): the torch reference reads and masks the whole response buffer at every step")


# a compiled step calls this once, while tracing, and keeps the answer
@torch.compiler.assume_constant_result
def _response_kernel_imports() -> bool:
    """Whether triton_decode_response imports (Triton does not, on some CPU installs)."""
    return optional_module("longstraw_kernels.attention.triton_decode_response") is not None


def response_partials_torch(q_BQD, k_BSKD, v_BSKD, filled_1, *, scale: float):
    """The reference of `response_partials`: all S slots upcast, the empty ones masked. -> (out [1, B, Q, D], lse
    [1, B, Q]) in fp32 (fp64 stays fp64)."""
    B, Q, D = q_BQD.shape
    S, K = k_BSKD.shape[1:3]
    dtype = compute_dtype(q_BQD.dtype)
    q_BKGD = q_BQD.reshape(B, K, Q // K, D).to(dtype)
    scores_BKGS = torch.einsum("bkgd,bskd->bkgs", q_BKGD, k_BSKD.to(dtype)) * scale
    valid_S = torch.arange(S, device=q_BQD.device) < filled_1
    scores_BKGS = scores_BKGS.masked_fill(~valid_S, float("-inf"))
    lse_BKG = torch.logsumexp(scores_BKGS, dim=-1)
    out_BKGD = torch.einsum("bkgs,bskd->bkgd", torch.exp(scores_BKGS - lse_BKG[..., None]), v_BSKD.to(dtype))
    return out_BKGD.reshape(1, B, Q, D), lse_BKG.reshape(1, B, Q)


def response_partials(q_BQD, k_BSKD, v_BSKD, filled_1, *, scale: float):
    """Each response's query against its own keys, the first `filled_1` (a device int tensor [1]) slots of a
    preallocated buffer, as partials over slot ranges (the Triton kernel on CUDA, else `response_partials_torch`).
    -> (out [N, B, Q, D], lse [N, B, Q]) fp32+, for `merge_partials`."""
    if _response_triton(q_BQD, k_BSKD):
        from longstraw_kernels.attention import triton_decode_response

        return triton_decode_response.response_partials(q_BQD, k_BSKD, v_BSKD, filled_1, scale=scale)
    return response_partials_torch(q_BQD, k_BSKD, v_BSKD, filled_1, scale=scale)


def cascade_decode_attention(q_BQD, k_pages_PKD, v_pages_PKD, k_BSKD, v_BSKD, filled_1, *, scale,
                             pages_fn=decode_pages_attention):
    """Pages part (shared by all responses, `pages_fn`: context parallel swaps in its cross-rank version) and the
    response part over the first `filled_1` slots, merged by log-sum-exp. -> out_BQD in q's dtype."""
    out_p_BQD, lse_p_BQ = pages_fn(q_BQD, k_pages_PKD, v_pages_PKD, scale=scale)
    out_r_NBQD, lse_r_NBQ = response_partials(q_BQD, k_BSKD, v_BSKD, filled_1, scale=scale)
    # merged in the pages' lse dtype
    compute = lse_p_BQ.dtype
    out_BQD, _ = merge_partials(torch.cat([out_p_BQD[None].to(compute), out_r_NBQD.to(compute)]),
                                torch.cat([lse_p_BQ[None], lse_r_NBQ.to(compute)]), q_BQD.dtype)
    return out_BQD
