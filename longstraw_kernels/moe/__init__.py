"""MoE routing at decode: `route_select`, a sigmoid router's top-k experts and their weights from its logits in one
Triton launch (triton_route.py), which glm52's decode step takes by default where `route_serves`
(models/glm52/decode.py; `kernels.router=torch`: the router module). Inside a compiled graph it is one opaque op
(`longstraw::route_select`)."""

from __future__ import annotations

import torch

from longstraw_kernels import optional_module

__all__ = ["route_select", "route_serves"]


def route_serves(logits_NE: torch.Tensor, k: int) -> bool:
    """Whether `route_select` runs for logits like these (triton_route.supported: CUDA, fp32; Triton importable)."""
    module = optional_module("longstraw_kernels.moe.triton_route") if logits_NE.is_cuda else None
    return module is not None and module.supported(logits_NE, k)


def route_select(logits_NE: torch.Tensor, bias_E: torch.Tensor, k: int, norm: bool,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, k] int64, weights [N, k] fp32): the k best of sigmoid(logits) + bias, highest first, and
    their sigmoid scores, renormalised where `norm`, times `scaling` (triton_route.py). The caller checked
    `route_serves` (tests call it on CPU, under Triton's interpreter)."""
    if torch.compiler.is_compiling():
        return _route_op(logits_NE, bias_E, k, norm, scaling)
    return _route(logits_NE, bias_E, k, norm, scaling)


def _route(logits_NE, bias_E, k, norm, scaling):
    from longstraw_kernels.moe.triton_route import route_select_triton

    return route_select_triton(logits_NE, bias_E, k, norm, scaling)


@torch.library.custom_op("longstraw::route_select", mutates_args=())
def _route_op(logits_NE: torch.Tensor, bias_E: torch.Tensor, k: int, norm: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _route(logits_NE, bias_E, k, norm, scaling)


@_route_op.register_fake
def _(logits_NE, bias_E, k, norm, scaling):
    N = logits_NE.shape[0]
    return (logits_NE.new_empty(N, k, dtype=torch.int64), logits_NE.new_empty(N, k, dtype=torch.float32))
