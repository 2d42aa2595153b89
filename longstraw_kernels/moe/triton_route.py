"""A sigmoid router's choice and weights in one Triton launch, for the decode step's few tokens on CUDA: from the
router's logits [N, E] (its fp32 GEMM, cuBLAS), one program a token computes

    scores = sigmoid(logits),  choice = scores + bias,  the k best of choice (highest first; the lowest expert on
    ties),  w = scores at them, divided by their sum (+ 1e-20) where norm, times the scaling

where the model's router (models/glm52/model.py `TopkRouter` without group limits: every group kept) runs the
sigmoid and the bias add, a top-k and its sort, a gather, a sum, a division and a product (glm52_mini's compiled
decode step on an H200: the top-k and the sort 22 launches and 0.10 ms a step, beside inductor's small fused kernels
around them; the GEMM before stays cuBLAS's). Every step in fp32; the top-k is k passes of a max over E
entries in registers. Exactness: tests/kernels/test_route.py (Triton's interpreter on CPU) against `TopkRouter`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_EXPERTS", "route_select_triton", "supported"]

# the experts a program holds in registers (GLM-5's 256)
MAX_EXPERTS = 1024


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, E, stride_ln, stride_in, stride_wn, scaling,
                  K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    e_E = tl.arange(0, BLOCK_E)
    valid_E = e_E < E
    logits_E = tl.load(logits_ptr + n * stride_ln + e_E, mask=valid_E, other=0.0).to(tl.float32)
    scores_E = 1.0 / (1.0 + tl.exp(-logits_E))
    bias_E = tl.load(bias_ptr + e_E, mask=valid_E, other=0.0).to(tl.float32)
    choice_E = tl.where(valid_E, scores_E + bias_E, float("-inf"))
    slot_K = tl.arange(0, BLOCK_K)
    idx_K = tl.zeros((BLOCK_K,), dtype=tl.int32)
    w_K = tl.zeros((BLOCK_K,), dtype=tl.float32)
    total = 0.0
    for i in tl.static_range(K):
        best = tl.max(choice_E, axis=0)
        pick = tl.min(tl.where(choice_E == best, e_E, BLOCK_E), axis=0)
        w = tl.sum(tl.where(e_E == pick, scores_E, 0.0), axis=0)
        idx_K = tl.where(slot_K == i, pick, idx_K)
        w_K = tl.where(slot_K == i, w, w_K)
        total += w
        choice_E = tl.where(e_E == pick, float("-inf"), choice_E)
    if NORM:
        w_K = w_K / (total + 1e-20)
    tl.store(idx_ptr + n * stride_in + slot_K, idx_K.to(tl.int64), mask=slot_K < K)
    tl.store(w_ptr + n * stride_wn + slot_K, w_K * scaling, mask=slot_K < K)


def supported(logits_NE: torch.Tensor, k: int) -> bool:
    """fp32 logits [N, E] on CUDA (rows contiguous), 1 <= k <= E <= MAX_EXPERTS."""
    return (logits_NE.is_cuda and logits_NE.dtype == torch.float32 and logits_NE.dim() == 2
            and logits_NE.stride(-1) == 1 and 1 <= k <= logits_NE.shape[1] <= MAX_EXPERTS)


def route_select_triton(logits_NE: torch.Tensor, bias_E: torch.Tensor, k: int, norm: bool,
                        scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (expert ids [N, k] int64, weights [N, k] fp32) of the router's logits (see the module doc)."""
    N, E = logits_NE.shape
    idx_Nk = torch.empty(N, k, dtype=torch.int64, device=logits_NE.device)
    w_Nk = torch.empty(N, k, dtype=torch.float32, device=logits_NE.device)
    if N:
        _route_kernel[(N,)](logits_NE, bias_E, idx_Nk, w_Nk, E, logits_NE.stride(0), idx_Nk.stride(0),
                            w_Nk.stride(0), float(scaling), K=k, BLOCK_K=triton.next_power_of_2(k),
                            BLOCK_E=max(16, triton.next_power_of_2(E)), NORM=bool(norm), num_warps=4)
    return idx_Nk, w_Nk
