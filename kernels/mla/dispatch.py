"""sparse_mla_attention for any device: the Triton kernels (triton_sparse.py) when q and the pages are on one
CUDA device in one dtype among bf16 / fp16 / fp32 and Triton imports, the torch reference everywhere else (CPU,
pages offloaded to CPU, fp64, mixed dtypes). Same signature, same saved-tensor contract.

LONGSTRAW_MLA_KERNEL = auto (default) | torch: torch forces the reference (A/B benchmarks, or a fallback should
the kernel misbehave). Under auto the backward is the Triton dq when no page needs a gradient, the torch
chunked backward otherwise (see triton_sparse.TritonSparseMLA).
"""

from __future__ import annotations

import torch

from longstraw_kernels import kernel_choice, optional_module
from longstraw_kernels.mla import reference


def triton_module():
    """longstraw_kernels.mla.triton_sparse, or None where Triton does not import."""
    return optional_module("longstraw_kernels.mla.triton_sparse")


def use_triton(q_BTHA, latent_PL, rope_PR, idx_BTK) -> bool:
    if kernel_choice("LONGSTRAW_MLA_KERNEL") == "torch":
        return False
    if not (q_BTHA.is_cuda and latent_PL.device == q_BTHA.device and rope_PR.device == q_BTHA.device):
        return False
    module = triton_module()
    return module is not None and module.supported(q_BTHA, latent_PL, rope_PR, idx_BTK)


# opaque to torch.compile (the compiled decode step): inductor would re-trace the Triton kernel inside
@torch.compiler.disable
def sparse_mla_attention(q_BTHA, latent_PL, rope_PR, idx_BTK, *, scale):
    """-> (out_BTHL in q's dtype, lse_BTH); see `reference.sparse_mla_attention`."""
    reference.check_shapes(q_BTHA, latent_PL, rope_PR, idx_BTK)
    if use_triton(q_BTHA, latent_PL, rope_PR, idx_BTK):
        return triton_module().TritonSparseMLA.apply(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)
    return reference._SparseMLA.apply(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)
