"""NF4 weights (QLoRA's frozen base): dequantisation to the weight's dtype.

`reference.py` holds the torch reference (torchao's arithmetic on the weight's parts); `triton_nf4.py` the GPU
kernel, the same numbers bit for bit. `dequantize(parts)` takes the kernel for CUDA weights in bf16 / fp16 /
fp32 when Triton imports, the reference otherwise; `kernels.nf4=torch` forces the reference (A/B runs).
It is a registered torch op (`longstraw::nf4_dequantize`): torch.compile (the compiled decode step) keeps it as
one call instead of tracing into it. It has no gradient: the weight is frozen, and the caller's autograd
(longstraw_cli.quantize) dequantises again in its backward. See README.md.
"""

from __future__ import annotations

import torch

from longstraw_kernels import kernel_choice, optional_module
from longstraw_kernels.nf4.reference import BLOCK, NF4Parts, dequantize_reference

__all__ = ["BLOCK", "NF4Parts", "dequantize", "dequantize_reference"]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the kernel's (triton_nf4._TL_DTYPE)


def _kernel(device: torch.device, dtype: torch.dtype):
    """The Triton entry for a weight on `device` in `dtype`, or None (the reference computes)."""
    if kernel_choice("nf4") != "auto" or device.type != "cuda" or dtype not in _KERNEL_DTYPES:
        return None
    module = optional_module("longstraw_kernels.nf4.triton_nf4")
    return None if module is None else module.dequantize_triton


@torch.library.custom_op("longstraw::nf4_dequantize", mutates_args=())
def _dequantize_op(codes: torch.Tensor, scalers: torch.Tensor, factors: torch.Tensor, mean: torch.Tensor,
                   table: torch.Tensor, n: int, k: int, scaler_block: int) -> torch.Tensor:
    parts = NF4Parts(codes, scalers, factors, mean, table, (n, k), scaler_block)
    kernel = _kernel(codes.device, table.dtype)
    return dequantize_reference(parts) if kernel is None else kernel(parts)


@_dequantize_op.register_fake
def _(codes, scalers, factors, mean, table, n, k, scaler_block):
    return table.new_empty(n, k)


def dequantize(p: NF4Parts) -> torch.Tensor:
    """W [N, K] in its dtype, bit for bit torchao's `get_original_weight`."""
    return _dequantize_op(p.codes, p.scalers, p.factors, p.mean, p.table, *p.shape, p.scaler_block)
