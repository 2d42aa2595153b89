"""Sparse absorbed-MLA attention (glm52 DSA replay): selected prompt pages, merged by LSE with response keys.

`reference.py` holds the torch reference; a GPU kernel beside it keeps the same signature."""

from longstraw_kernels.mla.reference import dense_mla_attention, merge_lse, sparse_mla_attention

__all__ = ["dense_mla_attention", "merge_lse", "sparse_mla_attention"]
