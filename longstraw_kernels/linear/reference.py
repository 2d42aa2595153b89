"""The decode step's linears with what surrounds them, in torch: the reference of `triton_skinny.py`'s kernel.

    y = [rmsnorm(x) or gatednorm(x, z) or x] @ W^T   (RMSNorm scaled by 1 + g, as the qwen36 model's `RMSNorm`;
                                                      or GDN's output norm: each head of x normalised, scaled by
                                                      w, times silu(z), as its `GatedRMSNorm`)
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


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim in fp32 (at least), rounded to x's dtype, scaled by w, times silu(z) in fp32
    (at least), rounded to x's dtype."""
    h = at_least_fp32(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = w * h.to(x.dtype)
    return (h * F.silu(at_least_fp32(z))).to(x.dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up, each rounded to the inputs' dtype (torch's two kernels)."""
    return F.silu(gate) * up


def decode_linear_reference(x_MK: torch.Tensor, weight_NK: torch.Tensor, *, up_NK: torch.Tensor | None = None,
                            norm_K: torch.Tensor | None = None, eps: float = 1e-6,
                            residual_MN: torch.Tensor | None = None, gate_MK: torch.Tensor | None = None,
                            gate_norm_V: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N], as the module doc. gate_MK and gate_norm_V (given together, without norm_K): the
    gated norm over heads of V = len(gate_norm_V) features."""
    if (gate_MK is None) != (gate_norm_V is None) or (gate_MK is not None and norm_K is not None):
        raise ValueError("the gated norm takes gate_MK and gate_norm_V together, and no norm_K beside them")
    h = x_MK if norm_K is None else rms_norm_one_plus(x_MK, norm_K, eps)
    if gate_MK is not None:
        V = gate_norm_V.shape[0]
        heads = (*x_MK.shape[:-1], x_MK.shape[-1] // V, V)
        h = gated_rms_norm(x_MK.reshape(heads), gate_MK.reshape(heads), gate_norm_V, eps).reshape(x_MK.shape)
    y = F.linear(h, weight_NK)
    if up_NK is not None:
        y = silu_mul_reference(y, F.linear(h, up_NK))
    return y if residual_MN is None else residual_MN + y
