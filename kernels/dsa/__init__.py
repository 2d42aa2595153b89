"""DSA lightning-indexer scores (glm52): sum_j w_j relu(scale * q_j . k) per query and key, fp32.

`reference.py` holds the torch reference; `triton_scores.py` the fused Triton kernel, same contract.
`indexer_scores` takes the kernel for CUDA tensors in fp32 / bf16 / fp16 when Triton imports, the reference
otherwise; LONGSTRAW_DSA_KERNEL=torch forces the reference (benchmarks, A/B runs)."""

from __future__ import annotations

import torch

from longstraw_kernels import compute_dtype, kernel_choice, optional_module
from longstraw_kernels.dsa.reference import indexer_scores_reference
from longstraw_kernels.dsa.topk import topk_lowest_position

__all__ = ["compute_dtype", "indexer_scores", "indexer_scores_reference", "topk_lowest_position"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_scores():
    """The Triton entry, or None when Triton does not import (CPU-only installs)."""
    module = optional_module("longstraw_kernels.dsa.triton_scores")
    return None if module is None else module.indexer_scores_triton


# opaque to torch.compile (the compiled decode step): inductor would re-trace the Triton kernel inside
@torch.compiler.disable
def indexer_scores(q_BTJI: torch.Tensor, w_BTJ: torch.Tensor, k: torch.Tensor, scale: float,
                   offset: int | None = None) -> torch.Tensor:
    """Index scores [B, T, S] of queries [B, T, J, I] (per-head weights w [B, T, J]) against keys [S, I] (shared)
    or [B, S, I]; with `offset`, -inf where s > t + offset. See `reference.indexer_scores_reference`."""
    choice = kernel_choice("LONGSTRAW_DSA_KERNEL")
    kernel = _triton_scores() if q_BTJI.is_cuda and choice == "auto" else None
    # fp64 (tests of the algorithm) has no tensor-core path: the reference computes it
    if kernel is None or compute_dtype(q_BTJI) != torch.float32 or k.dtype not in _KERNEL_DTYPES:
        return indexer_scores_reference(q_BTJI, w_BTJ, k, scale, offset)
    return kernel(q_BTJI, w_BTJ, k, scale, offset)
