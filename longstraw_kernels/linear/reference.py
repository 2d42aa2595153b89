"""The decode step's linears with what surrounds them, in torch: the reference of `triton_skinny.py`'s kernel.

    y = [rmsnorm(x) or x] @ W^T                      (RMSNorm scaled by 1 + g, as the qwen36 model's `RMSNorm`)
    y = silu(y) * ([rmsnorm(x) or x] @ U^T)          (glu: U the up linear's weight beside the gate's W)
    y = residual + y                                 (residual)

Each step rounds to x's dtype where the model's modules do (the norm's output, the product, silu's output, the
sum), so this equals the modules called one after another.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw_kernels import at_least_fp32


def rms_norm_one_plus(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (at least) scaled by (1 + g), rounded to x's dtype."""
    h = at_least_fp32(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + at_least_fp32(g))).type_as(x)


def decode_linear_reference(x_MK: torch.Tensor, weight_NK: torch.Tensor, *, up_NK: torch.Tensor | None = None,
                            norm_K: torch.Tensor | None = None, eps: float = 1e-6,
                            residual_MN: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N], as the module doc."""
    h = x_MK if norm_K is None else rms_norm_one_plus(x_MK, norm_K, eps)
    y = F.linear(h, weight_NK)
    if up_NK is not None:
        y = F.silu(y) * F.linear(h, up_NK)
    return y if residual_MN is None else residual_MN + y
