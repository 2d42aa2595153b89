"""Sparse absorbed-MLA attention (glm52 DSA replay): selected prompt pages, merged by LSE with response keys.

`reference.py` holds the torch reference; `triton_sparse.py` the GPU kernels (forward and dq) with the same
signature; `dispatch.py` picks between them per call."""

from longstraw_kernels.mla.dispatch import sparse_mla_attention, sparse_mla_two_sources
from longstraw_kernels.mla.reference import dense_mla_attention, merge_lse

__all__ = ["dense_mla_attention", "merge_lse", "sparse_mla_attention", "sparse_mla_two_sources"]
