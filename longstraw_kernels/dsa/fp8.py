"""The DSA indexer's scores in FP8 (`kernels.dsa_scores=fp8`), as DeepSeek-V3.2 runs its lightning indexer: queries
and keys rotated by one orthonormal Hadamard matrix, then each row (a query's head, a key) in float8_e4m3 with its
own fp32 scale; the q . k dots in FP8 (Hopper's FP8 tensor cores, fp32 accumulation), the scales applied after.

    score[t, s] = k_scale[s] * sum_j (w[t, j] * q_scale[t, j]) * relu(scale * q8[t, j] . k8[s])

equals the exact scores of the dequantised rows (q8 * q_scale, k8 * k_scale): relu(c x) = c relu(x) for c > 0, and
a product of two e4m3 values is exact in fp32. The rotation changes no dot product (H H^T = I) but spreads a row's
outliers over all its dims, so the per-row scale wastes less of e4m3's 3-bit mantissa on one large value.

Rounding moves scores, and the top-k that follows may then pick another key among near-ties: the selection is not
the exact one. Routing replay (rollout.replay_routing) still holds replay to the rollout's selection whatever the
rounding; without it, capture, decode and replay each select from FP8 scores alike (the same per-row quantisation
wherever a row is scored: under context parallel each rank quantises its own keys as one rank would).

Legend: J index heads, I index head dim (a power of two for the rotation), S keys.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
# e4m3's largest finite value: a row's largest |x| maps to it
FP8_MAX = 448.0
# a row of zeros keeps a positive scale (its values are 0 whatever it is)
_MIN_AMAX = 1e-12


class Fp8Keys(NamedTuple):
    """Index keys in FP8: values [..., S, I] (float8_e4m3fn, rotated) and their scales [..., S] (fp32)."""

    values: torch.Tensor
    scales: torch.Tensor


# keys quantised at once (their fp32 rotation is 512 bytes a key)
_KEYS_AT_ONCE = 1 << 18


def rotated(x: torch.Tensor) -> torch.Tensor:
    """x [..., I] times the orthonormal Sylvester-Hadamard matrix, in fp32 (or wider), by the fast transform's
    log2(I) butterflies (plain tensor ops: a compiled decode step traces them); I not a power of two: unrotated."""
    n = x.shape[-1]
    out = x.to(torch.promote_types(x.dtype, torch.float32))
    if n < 2 or n & (n - 1):
        return out
    lead, half = out.shape[:-1], 1
    while half < n:
        pairs = out.reshape(*lead, n // (2 * half), 2, half)
        out = torch.stack((pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]), dim=-2)
        half *= 2
    return out.reshape(*lead, n) * n**-0.5


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., I] rotated (`rotated`) and in e4m3 -> (values [..., I] e4m3, scales [...] fp32): each row's
    largest |value| becomes FP8_MAX, values round to nearest."""
    r = rotated(x)
    scales = (r.abs().amax(-1).clamp_min(_MIN_AMAX) / FP8_MAX).float()
    return (r / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def quantize_keys(k: torch.Tensor) -> Fp8Keys:
    """Index keys [..., S, I] in FP8 (`quantize_rows`); FP8 keys come back as they are."""
    if isinstance(k, Fp8Keys):
        return k
    S = k.shape[-2]
    if S <= _KEYS_AT_ONCE:
        return Fp8Keys(*quantize_rows(k))
    values = torch.empty(k.shape, dtype=FP8, device=k.device)
    scales = torch.empty(k.shape[:-1], dtype=torch.float32, device=k.device)
    for s0 in range(0, S, _KEYS_AT_ONCE):
        chunk = slice(s0, min(S, s0 + _KEYS_AT_ONCE))
        values[..., chunk, :], scales[..., chunk] = quantize_rows(k[..., chunk, :])
    return Fp8Keys(values, scales)


def num_keys(k: torch.Tensor | Fp8Keys) -> int:
    """The keys of a group [..., S, I], plain or FP8."""
    return (k.values if isinstance(k, Fp8Keys) else k).shape[-2]


def quantize_queries(q_BTJI: torch.Tensor, w_BTJ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries [B, T, J, I] in FP8 (`quantize_rows`, a scale per query head) -> (values, weights times those
    scales [B, T, J], fp32 or wider)."""
    values, scales = quantize_rows(q_BTJI)
    return values, w_BTJ * scales.to(w_BTJ.dtype)


def dequantized(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 rows back in fp32: what the FP8 kernel's dots compute exactly (the reference of the FP8 path)."""
    return values.float() * scales[..., None]
