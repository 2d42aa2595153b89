"""NF4 dequantisation in plain torch: torchao's `NF4Tensor.get_original_weight`, step for step, on its parts.

The weight W [N, K] (row-major, flattened) is stored as
- codes: uint8 [N*K/2], two 4-bit indices into `table` a byte, the even element in the high nibble;
- scalers: int8 [N*K/64], each 64-element block's absmax, less their mean, quantised per scaler block;
- factors: [N*K/64/scaler_block] in W's dtype, each scaler block's quantisation factor;
- mean: 0-d, W's dtype, the absmaxes' mean; table: the 16 normal-float levels in W's dtype.

    absmax[b] = round_dtype(round_dtype(scalers[b] / factors[b // scaler_block]) + mean)
    W.flat[i] = round_dtype(table[code(i)] * absmax[i // 64])

Each operation rounds to W's dtype as torch's elementwise ops do (computed in fp32, rounded once): the Triton
kernels reproduce these numbers bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 64  # weights per absmax


class NF4Parts(NamedTuple):
    """An NF4 weight's storage (see the module docstring) and its logical shape [N, K]."""
    codes: torch.Tensor
    scalers: torch.Tensor
    factors: torch.Tensor
    mean: torch.Tensor
    table: torch.Tensor
    shape: tuple[int, int]
    scaler_block: int

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype


def absmax_reference(p: NF4Parts) -> torch.Tensor:
    """Every 64-block's absmax [N*K/64] in W's dtype."""
    quantised = p.scalers.view(-1, p.scaler_block)
    return (quantised / p.factors.unsqueeze(-1)).flatten().to(p.dtype) + p.mean


def dequantize_reference(p: NF4Parts) -> torch.Tensor:
    """W [N, K] in its dtype."""
    absmax = absmax_reference(p).repeat_interleave(BLOCK // 2)
    high = p.table[(p.codes >> 4).long()] * absmax
    low = p.table[(p.codes & 0xF).long()] * absmax
    return torch.stack([high, low], dim=-1).reshape(p.shape)

