"""Token log-probabilities from final hidden states without materialising [tokens x vocab] at once.

Logits are formed for `chunk_size` tokens at a time. Under autograd each chunk is checkpointed, so the backward
recomputes that chunk's logits instead of keeping them: live logits memory is one chunk, whatever the length.

Legend: B batch, T tokens, C hidden, V vocab.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(h_BTC: torch.Tensor, weight_VC: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    logits_BTV = torch.nn.functional.linear(h_BTC, weight_VC)
    # at least fp32: bf16 logits would round log-probs; fp64 stays fp64
    logits_BTV = logits_BTV.to(torch.promote_types(logits_BTV.dtype, torch.float32))
    picked_BT = logits_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    return picked_BT - torch.logsumexp(logits_BTV, dim=-1)


def token_logprobs(
    h_BTC: torch.Tensor, weight_VC: torch.Tensor, targets_BT: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """log softmax(h W^T)[target] per token, [B, T], in fp32 (fp64 for fp64 inputs)."""
    if h_BTC.shape[1] == 0:
        return h_BTC.new_zeros(targets_BT.shape, dtype=torch.promote_types(h_BTC.dtype, torch.float32))
    pieces = []
    for start in range(0, h_BTC.shape[1], chunk_size):
        h = h_BTC[:, start : start + chunk_size]
        t = targets_BT[:, start : start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or weight_VC.requires_grad):
            pieces.append(checkpoint(_chunk_logprobs, h, weight_VC, t, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(h, weight_VC, t))
    return torch.cat(pieces, dim=1)
