"""The decode step's linears with their norm, silu * up and residual fused (reference.py: the torch reference;
triton_skinny.py: one Triton launch a linear for a few rows, same contract).

`decode_linear` takes the kernel for CUDA bf16/fp16 inputs of at most `MAX_ROWS` rows when Triton imports, the
reference otherwise; `kernels.decode_linear=torch` forces the reference (A/B runs).
"""

from __future__ import annotations

import functools
import logging

import torch

from longstraw_kernels import kernel_choice, optional_module
from longstraw_kernels.linear.reference import decode_linear_reference, gated_rms_norm, rms_norm_one_plus

__all__ = ["decode_linear", "decode_linear_reference", "gate_serves", "gated_rms_norm", "kernel_entry", "kernel_module",
           "kernel_serves", "rms_norm_one_plus"]

log = logging.getLogger(__name__)


def kernel_module():
    """The decode linear kernel's module where kernels.decode_linear=auto and Triton imports, else None."""
    if kernel_choice("decode_linear") != "auto":
        return None
    return optional_module("longstraw_kernels.linear.triton_skinny")


def kernel_entry(x: torch.Tensor, *weights: torch.Tensor):
    """The Triton entry (`decode_linear_triton`) that `decode_linear(x, *weights, ...)` would take, or None. A
    compiled step should hold it, asked for once outside the step: the module lookup is cached by functools, which
    torch.compile warns about when it traces it."""
    if not x.is_cuda:
        return None
    module = kernel_module()
    if module is None:  # torch chosen, or no Triton (said at the run's start: FAST_PATHS)
        return None
    if not module.supported(x, *weights):
        rows = x.numel() // max(x.shape[-1], 1)
        _say_the_modules_run(rows, x.dtype, tuple(sorted({str(w.dtype) for w in weights})), module.MAX_ROWS)
        return None
    return module.decode_linear_triton


@functools.cache
def _say_the_modules_run(rows: int, dtype: torch.dtype, weight_dtypes: tuple, max_rows: int) -> None:
    log.warning("decode linear kernel: %d rows of %s (weights %s) are not what it takes (at most %d rows, bf16/fp16, "
                "contiguous in K); the modules run the decode's linears (cuBLAS and a kernel per norm, silu and add; "
                "logged once)", rows, dtype, ", ".join(weight_dtypes), max_rows)


def kernel_serves(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `decode_linear(x, *weights, ...)` runs the Triton kernel."""
    return kernel_entry(x, *weights) is not None


def gate_serves(K: int, gate_norm_V: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a gated norm with weight gate_norm_V (over heads of its length) before a linear of K
    inputs of `dtype` (triton_skinny.gate_supported), where the kernel runs at all; a norm it does not take says
    once that the norm runs as its own kernels."""
    module = kernel_module()
    if module is None:
        return False
    if not module.gate_supported(K, gate_norm_V, dtype):
        _say_the_gated_norm_runs_apart(gate_norm_V.shape[0], K, str(gate_norm_V.dtype), str(dtype))
        return False
    return True


@functools.cache
def _say_the_gated_norm_runs_apart(V: int, K: int, norm_dtype: str, dtype: str) -> None:
    log.warning("decode linear kernel: a gated norm over heads of %d (K = %d, norm %s, rows %s) is not what it takes "
                "(heads a power of two in [16, 256] dividing K, the norm in the rows' dtype); the norm runs as its own "
                "kernels before the linear (logged once)", V, K, norm_dtype, dtype)


def decode_linear(x: torch.Tensor, weight_NK: torch.Tensor, *, up_NK: torch.Tensor | None = None,
                  norm_K: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                  gate: torch.Tensor | None = None, gate_norm_V: torch.Tensor | None = None) -> torch.Tensor:
    """[rmsnorm(x) or gatednorm(x, gate) or x] @ W^T; silu of it times the same @ U^T where up_NK is given;
    + residual where given (reference.py)."""
    serves = kernel_serves(x, weight_NK, *([] if up_NK is None else [up_NK]))
    if serves and (gate_norm_V is None or gate_serves(x.shape[-1], gate_norm_V, x.dtype)):
        return kernel_module().decode_linear_triton(x, weight_NK, up_NK=up_NK, norm_K=norm_K, eps=eps,
                                                    residual=residual, gate=gate, gate_norm_V=gate_norm_V)
    return decode_linear_reference(x, weight_NK, up_NK=up_NK, norm_K=norm_K, eps=eps, residual_MN=residual,
                                   gate_MK=gate, gate_norm_V=gate_norm_V)
