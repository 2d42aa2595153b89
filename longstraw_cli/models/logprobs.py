"""Token log-probabilities from final hidden states without materialising [tokens x vocab] at once.

Logits are formed for `chunk_size` tokens at a time. Under autograd each chunk is checkpointed, so the backward
recomputes that chunk's logits instead of keeping them: live logits memory is one chunk, whatever the length.

Legend: B batch, T tokens, N = B * T, C hidden, V vocab.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(h_NC: torch.Tensor, weight_VC: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    logits_NV = torch.nn.functional.linear(h_NC, weight_VC)
    # at least fp32: bf16 logits would round log-probs; fp64 stays fp64
    logits_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    picked_N = logits_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1)
    return picked_N - torch.logsumexp(logits_NV, dim=-1)


def token_logprobs(
    h_BTC: torch.Tensor, weight_VC: torch.Tensor, targets_BT: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """log softmax(h W^T)[target] per token, [B, T], in fp32 (fp64 for fp64 inputs). Chunks run over the
    flattened batch x tokens, so a batch of responses costs no more logits memory than one."""
    B, T = targets_BT.shape
    if B * T == 0:
        return h_BTC.new_zeros(targets_BT.shape, dtype=torch.promote_types(h_BTC.dtype, torch.float32))
    h_NC, targets_N = h_BTC.reshape(B * T, -1), targets_BT.reshape(B * T)
    pieces = []
    for start in range(0, B * T, chunk_size):
        h = h_NC[start : start + chunk_size]
        t = targets_N[start : start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or weight_VC.requires_grad):
            pieces.append(checkpoint(_chunk_logprobs, h, weight_VC, t, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(h, weight_VC, t))
    return torch.cat(pieces).reshape(B, T)
