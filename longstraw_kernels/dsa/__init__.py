"""DSA lightning-indexer scores (glm52): sum_j w_j relu(scale * q_j . k) per query and key, fp32.

`reference.py` holds the torch reference; `triton_scores.py` the fused Triton kernel, same contract.
`indexer_scores` takes the kernel for CUDA tensors in fp32 / bf16 / fp16 when Triton imports, the reference
otherwise; `kernels.dsa=torch` forces the reference (benchmarks, A/B runs). Few query rows (the decode's) take the
kernel's few-rows form, the heads folded into the dot's rows and a few programs an SM looping over the key tiles,
where it serves: on an H200 at 8 rows of 262K keys, 0.043 ms at 16 heads and 0.084 at 32 against the head loop's
0.082 and 0.139 (docs/BENCHMARKS.md, 2026-12-04)."""

from __future__ import annotations

import torch

from longstraw_kernels import compute_dtype, kernel_choice, optional_module
from longstraw_kernels.dsa.reference import indexer_scores_reference
from longstraw_kernels.dsa.topk import prepare_topk, topk_lowest_position

__all__ = ["compute_dtype", "indexer_scores", "indexer_scores_reference", "prepare_topk", "topk_lowest_position"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_scores():
    """The Triton entry, or None when Triton does not import (CPU-only installs)."""
    module = optional_module("longstraw_kernels.dsa.triton_scores")
    return None if module is None else module.indexer_scores_triton


def _folded_scores(q_BTJI: torch.Tensor, k: torch.Tensor):
    """The folded kernel's entry where it serves these query rows, else None."""
    module = optional_module("longstraw_kernels.dsa.triton_scores")
    if module is None or not module.folded_serves(q_BTJI, k):
        return None
    return module.indexer_scores_folded_triton


def indexer_scores(q_BTJI: torch.Tensor, w_BTJ: torch.Tensor, k: torch.Tensor, scale: float,
                   offset: int | None = None) -> torch.Tensor:
    """Index scores [B, T, S] in `compute_dtype(q)` of queries [B, T, J, I] (per-head weights w [B, T, J]) against
    keys [S, I] (shared) or [B, S, I]; with `offset`, -inf where s > t + offset. See
    `reference.indexer_scores_reference`. Inside a compiled graph (the decode step) it is one opaque op
    (`longstraw::dsa_indexer_scores`): inductor does not re-trace the Triton kernel, and dynamo does not break
    the graph there, so the page count stays a dynamic size across it."""
    if torch.compiler.is_compiling():
        return _indexer_scores_op(q_BTJI, w_BTJ, k, scale, offset)
    return _indexer_scores(q_BTJI, w_BTJ, k, scale, offset)


def _indexer_scores(q_BTJI, w_BTJ, k, scale, offset):
    kernel = _triton_scores() if q_BTJI.is_cuda and kernel_choice("dsa") == "auto" else None
    # fp64 (tests of the algorithm) has no tensor-core path: the reference computes it
    if kernel is None or compute_dtype(q_BTJI) != torch.float32 or k.dtype not in _KERNEL_DTYPES:
        scores_BTS = indexer_scores_reference(q_BTJI, w_BTJ, k, scale, offset)
    else:
        scores_BTS = (_folded_scores(q_BTJI, k) or kernel)(q_BTJI, w_BTJ, k, scale, offset)
    # no key at all comes back in q's dtype from the reference: the op's output dtype is one
    return scores_BTS.to(compute_dtype(q_BTJI))


# no gradient: the scores only feed a top-k (the selection is not differentiated)
@torch.library.custom_op("longstraw::dsa_indexer_scores", mutates_args=())
def _indexer_scores_op(q_BTJI: torch.Tensor, w_BTJ: torch.Tensor, k: torch.Tensor, scale: float,
                       offset: int | None) -> torch.Tensor:
    return _indexer_scores(q_BTJI, w_BTJ, k, scale, offset)


@_indexer_scores_op.register_fake
def _(q_BTJI, w_BTJ, k, scale, offset):
    B, T = q_BTJI.shape[:2]
    return q_BTJI.new_empty(B, T, k.shape[-2], dtype=compute_dtype(q_BTJI))
