"""Token embedding whose backward builds the weight gradient from the rows it touched.

A replay looks up about a thousand response tokens in a [vocab, hidden] table (248320 x 5120 for the 27B shape).
The stock backward goes through a float32 buffer of the whole table for bf16 weights; this one accumulates the
touched rows in float32 ([unique tokens, hidden]) and writes them into one zero table of the weight's dtype: the
transient is one weight-sized gradient, which autograd then adds into .grad. Values equal the stock backward up
to the order of summation of repeated tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from longstraw_kernels import compute_dtype


class _RowGradLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight_VC, ids):
        ctx.save_for_backward(ids)
        ctx.weight_meta = (weight_VC.shape, weight_VC.dtype, weight_VC.device)
        return nn.functional.embedding(ids, weight_VC)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        shape, dtype, device = ctx.weight_meta
        rows_U, inverse_N = torch.unique(ids.reshape(-1), return_inverse=True)
        acc_UC = torch.zeros(rows_U.numel(), shape[1], dtype=compute_dtype(dtype), device=device)
        acc_UC.index_add_(0, inverse_N, grad.reshape(-1, shape[1]).to(acc_UC.dtype))
        dweight_VC = torch.zeros(shape, dtype=dtype, device=device)
        dweight_VC[rows_U] = acc_UC.to(dtype)
        return dweight_VC, None


class Embedding(nn.Embedding):
    """nn.Embedding (same parameter, same state-dict name) with the row-wise backward above."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _RowGradLookup.apply(self.weight, ids)
        return nn.functional.embedding(ids, self.weight)
