"""qwen36's partial rotary position embedding: the step's cos / sin and their rotation of a head's first dims, used
by the model (`GatedAttention`) and the decode step (its fused query / key preparation)."""

from __future__ import annotations

import torch

from longstraw_kernels import compute_dtype


def rope_cos_sin(positions_T: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    # fp32 angles, as HF computes them, then cast to the activations' dtype
    angle_dtype = compute_dtype(dtype)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions_T.device).to(angle_dtype)
    inv_freq = 1.0 / (theta ** (exponents / rotary_dim))
    freqs_TR = positions_T.to(angle_dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs_TR, freqs_TR], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x_BTHD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos_TR.shape[-1]
    rot, rest = x_BTHD[..., :rotary_dim], x_BTHD[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos_TR[:, None, :], sin_TR[:, None, :]
    return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1)
