"""A decode step's sampling: each response's next token by the exponential race, with its log-prob and the
entropy at temperature 1 (reference.py: the torch reference; triton_race.py: two Triton launches, same contract).

`race_sample` takes the kernel for CUDA logits in fp32 / fp64 at top_p = 1 when Triton imports, the reference
otherwise (top-p's sort stays there); `kernels.sampling=torch` forces the reference (A/B runs). The race's
noise comes from the caller (rollout/native.py draws it from the rollout's generator), so both paths sample the
same token from the same noise, up to the rounding of near-ties.
"""

from __future__ import annotations

import torch

from longstraw_kernels import kernel_choice, optional_module
from longstraw_kernels.sampling.reference import race_sample_reference, race_tokens, token_scores

__all__ = ["race_sample", "race_sample_reference", "race_tokens", "token_scores"]

_KERNEL_DTYPES = (torch.float32, torch.float64)


def _kernel(logits_BV: torch.Tensor, top_p: float):
    """The Triton entry for these logits, or None (the reference computes)."""
    if (kernel_choice("sampling") != "auto" or not logits_BV.is_cuda or top_p < 1
            or logits_BV.dtype not in _KERNEL_DTYPES or logits_BV.stride(-1) != 1):
        return None
    module = optional_module("longstraw_kernels.sampling.triton_race")
    return None if module is None else module.race_sample_triton


def race_sample(logits_BV: torch.Tensor, race_BV: torch.Tensor | None, temperature: float, top_p: float,
                tokens_B: torch.Tensor, logp_B: torch.Tensor, entropy_B: torch.Tensor) -> None:
    """Writes each row's token (race_BV: Exp(1) noise [B, V], or None for greedy), its log-prob and the row's entropy
    at temperature 1 into tokens_B, logp_B and entropy_B (views of the rollout's buffers, any strides)."""
    kernel = _kernel(logits_BV, top_p)
    if kernel is None:
        race_sample_reference(logits_BV, race_BV, temperature, top_p, tokens_B, logp_B, entropy_B)
    else:
        kernel(logits_BV, race_BV, temperature, tokens_B, logp_B, entropy_B)
