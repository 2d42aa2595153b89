"""qwen36's norms and gates (and its MLP's SiLU(gate) * up): one Triton launch each forward, and one each backward
where a graph is recorded.

`kernels.norm` = auto (default) | torch. Under auto a CUDA call outside a compiled region takes `triton_norm.py`'s
kernel where it serves: bf16 / fp16 / fp32 rows of at most 16,384 that `rows_of` reads in place. A call that needs
no gradient (capture, scoring) is one forward launch; one that records a graph (replay, the exact walk) saves only
its inputs and runs one backward launch, where the reference saves fp32 copies of the rows and runs a chain of
kernels back. A compiled region (the decode step: inductor fuses these itself), the CPU, fp64 and torch run the
references; a CUDA operand the kernels cannot read in place is said once. Each function here has its reference's
contract; the kernels round as the references do in the forward, with a row's sum added in another order, and
compute each gradient in fp32, rounded once."""

from __future__ import annotations

import torch

from longstraw_kernels import at_least_fp32, kernel_choice, needs_grad, optional_module, say_once
from longstraw_kernels.gdn.reference import l2norm
from longstraw_kernels.linear.reference import gated_rms_norm, rms_norm_one_plus, silu_mul_reference

__all__ = ["gated_norm", "l2norm_fp32", "rms_norm", "silu_mul"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ROW = 16384


def _kernels(*tensors: torch.Tensor, flat: bool = False):
    """triton_norm where its kernels serve these operands (the first one's rows; with `flat`, each read as one
    contiguous run), else None."""
    x = tensors[0]
    if (kernel_choice("norm") != "auto" or not x.is_cuda or torch.compiler.is_compiling()
            or x.numel() == 0 or x.shape[-1] > MAX_ROW or any(t.dtype not in DTYPES for t in tensors)):
        return None
    module = optional_module("longstraw_kernels.norm.triton_norm")
    return module if module is not None and _read_in_place(module, tensors, flat) else None


def _read_in_place(module, tensors, flat: bool = False) -> bool:
    """Whether the kernels read these operands as they lie: those of the first one's shape as its rows
    (`rows_of`), or with `flat` each as one contiguous run (the SiLU * up launch), the others as a contiguous weight
    over one row. Where not, said once for each of the two readings: the reference runs."""
    x = tensors[0]
    for t in tensors:
        if t.shape == x.shape:
            readable = t.is_contiguous() if flat else module.rows_of(t) is not None
        else:
            readable = t.shape == x.shape[-1:] and t.is_contiguous()
        if not readable:
            how = "contiguous" if flat else "rows of a contiguous last dim, a weight over one row"
            say_once(f"norms: the Triton launch does not read an operand of shape {tuple(t.shape)}, strides "
                     f"{t.stride()} in place ({how}); the torch reference runs it (said once)",
                     key=f"norms: layout{' flat' if flat else ''}")
            return False
    return True


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by (1 + g): `rms_norm_one_plus`."""
    module = _kernels(x, g)
    return rms_norm_one_plus(x, g, eps) if module is None else module.rms_norm(x, g, eps)


def gated_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN's output norm: `gated_rms_norm`."""
    module = _kernels(x, z, w) if z.dtype == x.dtype == w.dtype and z.shape == x.shape else None
    return gated_rms_norm(x, z, w, eps) if module is None else module.gated_norm(x, z, w, eps)


def l2norm_fp32(x: torch.Tensor) -> torch.Tensor:
    """`l2norm(at_least_fp32(x))`: GDN's q and k. Where a graph is recorded they come from torch's conv as transposed
    views (the capture's conv kernel writes rows for graph-free forwards only): the reference takes them, unsaid."""
    if x.stride(-1) != 1 and needs_grad(x):
        return l2norm(at_least_fp32(x))
    module = _kernels(x)
    return l2norm(at_least_fp32(x)) if module is None else module.l2norm_fp32(x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_reference`: qwen36's MLP's SwiGLU before its down linear. The launch reads both operands flat: views
    that are not contiguous (the halves of one GEMM's output) take the reference, said once."""
    module = _kernels(gate, up, flat=True) if gate.shape == up.shape and gate.dtype == up.dtype else None
    return silu_mul_reference(gate, up) if module is None else module.silu_mul(gate, up)
