"""Linears that read one input, run as one GEMM in a decode step (both families' decoders): `InProjections` holds
their weights concatenated (a copy, made with the decoder), `EachLinear` calls them one by one where they cannot be
concatenated or the copies would take more than FUSED_SHARE of the device's memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FUSED_SHARE", "EachLinear", "InProjections", "concatenated_bytes", "fusable", "one_gemm_each"]


class InProjections:
    """Linears that read the same input as one GEMM: their weights concatenated [sum N, C] (a copy, made when the
    decoder is: the weights change every optimizer step). -> each linear's output, views of the one product."""

    def __init__(self, linears: list[nn.Linear]):
        self.weight_NC = torch.cat([m.weight.detach() for m in linears])
        self.sizes = [m.out_features for m in linears]

    def __call__(self, x_BTC: torch.Tensor) -> list[torch.Tensor]:
        return F.linear(x_BTC, self.weight_NC).split(self.sizes, dim=-1)

    def weights(self) -> tuple[list[torch.Tensor], list[int]]:
        """(the weights the products read: the one copy; each linear's out size)."""
        return [self.weight_NC], self.sizes


class EachLinear:
    """The same contract, the linears called one by one: not plain (LoRA, NF4, sharded parameters), or their copies
    would pass FUSED_SHARE."""

    def __init__(self, linears: list[nn.Module]):
        self.linears = linears

    def __call__(self, x_BTC: torch.Tensor) -> list[torch.Tensor]:
        return [m(x_BTC) for m in self.linears]

    def weights(self) -> tuple[list[torch.Tensor], list[int]]:
        """(each linear's weight; its out size)."""
        return [m.weight.detach() for m in self.linears], [m.out_features for m in self.linears]


# the most of a device's memory the concatenated input linears may take (a deterministic rule: the same choice, so
# the same rounding, on every run of a model on a kind of GPU)
FUSED_SHARE = 1 / 16


def fusable(linears: list[nn.Module]) -> bool:
    """Whether `linears` can run as one GEMM: plain bias-free nn.Linear over ordinary parameters of one dtype."""
    return all(type(m) is nn.Linear and m.bias is None and type(m.weight) is nn.Parameter
               and m.weight.dtype == linears[0].weight.dtype for m in linears)


def concatenated_bytes(layers: list[tuple[list[nn.Module], ...]]) -> int:
    """Bytes the concatenated copies of `layers`' groups (a tuple of linear groups a layer) take: every fusable
    group's weights."""
    return sum(m.weight.nbytes for layer in layers for group in layer if fusable(group) for m in group)


def one_gemm_each(layers: list[tuple[list[nn.Module], ...]], total_bytes: int | None) -> list[tuple]:
    """Each layer's groups as one GEMM each (`InProjections`) where the group is fusable and the copies of every
    fusable group together take at most FUSED_SHARE of the device's `total_bytes` (None: no limit, a CPU), else
    one by one (`EachLinear`)."""
    fuse = total_bytes is None or concatenated_bytes(layers) <= FUSED_SHARE * total_bytes
    return [tuple(InProjections(group) if fuse and fusable(group) else EachLinear(group) for group in layer)
            for layer in layers]
