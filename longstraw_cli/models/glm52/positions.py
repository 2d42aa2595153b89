"""Where glm52's keys sit: RoPE angles of positions and the key axis a query attends along. Shared by the
model's paths (model.py) and native decode (decode.py), which both import it; it imports neither.

Legend: T tokens (queries), F rotated pairs (rope dim / 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw_kernels import compute_dtype


def rope_cos_sin(positions_T: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [T, dim/2] of each rotated pair; fp32 angles as HF computes them, cast to the activations' dtype."""
    angle_dtype = compute_dtype(dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions_T.device).to(angle_dtype) / dim))
    freqs_TF = positions_T.to(angle_dtype)[:, None] * inv_freq[None, :]
    return freqs_TF.cos().to(dtype), freqs_TF.sin().to(dtype)


@dataclass
class KeyAxis:
    """The keys one call attends to: `num_pages` prompt pages (shared by the batch) then `num_new` per-sequence
    keys. Query t of T sees key position g iff g <= offset + t, offset = num_pages + num_new - T (capture:
    the block's own keys are already pages; replay/decode: the new keys end at the last query)."""

    num_pages: int
    num_new: int
    num_queries: int

    @property
    def offset(self) -> int:
        return self.num_pages + self.num_new - self.num_queries
