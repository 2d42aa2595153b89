"""replay_attention for any device: flash attention's forward on CUDA in bf16/fp16 where its masks fit, the
torch reference everywhere else (CPU, fp32/fp64, other shapes). Same signature, same saved-tensor contract."""

import torch

from longstraw_kernels.attention import reference
from longstraw_kernels.attention.flash import _FlashReplayAttention, flash_replay_attention_backward, flash_supported


def replay_attention(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, *, scale, block_size=1024,
                     return_lse=False):
    """-> out_BRQD [, lse_BQR]; see `reference.replay_attention`."""
    R, S = q_BRQD.shape[1], k_new_BSKD.shape[1]
    if S > R > 1 and flash_supported(q_BRQD, k_pages_PKD, k_new_BSKD[:, S - R :]):
        # a block of a response after earlier blocks (blockwise replay): flash takes the two parts apart
        return split_new_keys(replay_attention, q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD,
                              scale=scale, block_size=block_size, return_lse=return_lse)
    if not flash_supported(q_BRQD, k_pages_PKD, k_new_BSKD):
        return reference.replay_attention(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, scale=scale,
                                          block_size=block_size, return_lse=return_lse)
    reference._check_shapes(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, block_size)
    out_BRQD, lse_BQR = _FlashReplayAttention.apply(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD,
                                                    scale, block_size)
    return (out_BRQD, lse_BQR) if return_lse else out_BRQD


def replay_attention_backward(saved, needs_grad, dout_BRQD, dlse_BQR, *, scale, block_size=1024):
    """The backward of `replay_attention` from its saved tensors (q, k_pages, v_pages, k_new, v_new, out, lse),
    through the kernel the forward would take; see `reference.replay_attention_backward`."""
    q_BRQD, k_pages_PKD, _, k_new_BSKD = saved[:4]
    backward = (flash_replay_attention_backward if flash_supported(q_BRQD, k_pages_PKD, k_new_BSKD)
                else reference.replay_attention_backward)
    return backward(saved, needs_grad, dout_BRQD, dlse_BQR, scale=scale, block_size=block_size)


def split_new_keys(attention, q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, *, scale, block_size=1024,
                   return_lse=False):
    """The same attention when the R queries are the last R of S > R new keys (a response block after earlier
    blocks): `attention` over the pages plus the last R new keys (causal, S == R), and over each sequence's
    earlier S - R keys, which every query sees (no mask: they take the pages' place, S == 0), merged by LSE
    (differentiable). Both calls are ones flash attention serves."""
    R, S = q_BRQD.shape[1], k_new_BSKD.shape[1]
    out_a, lse_a = attention(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD[:, S - R :], v_new_BSKD[:, S - R :],
                             scale=scale, block_size=block_size, return_lse=True)
    none_BSKD = k_new_BSKD[:1, :0]
    parts = [attention(q_BRQD[b : b + 1], k_new_BSKD[b, : S - R], v_new_BSKD[b, : S - R], none_BSKD, none_BSKD,
                       scale=scale, block_size=block_size, return_lse=True) for b in range(q_BRQD.shape[0])]
    out_b = torch.cat([o for o, _ in parts]) if len(parts) > 1 else parts[0][0]
    lse_b = torch.cat([lse for _, lse in parts]) if len(parts) > 1 else parts[0][1]
    lse_BQR = torch.logaddexp(lse_a, lse_b)
    # [B, Q, R] weights onto [B, R, Q, 1]
    w_a, w_b = ((lse - lse_BQR).exp().transpose(1, 2)[..., None] for lse in (lse_a, lse_b))
    out_BRQD = (w_a * out_a.to(w_a.dtype) + w_b * out_b.to(w_b.dtype)).to(q_BRQD.dtype)
    return (out_BRQD, lse_BQR) if return_lse else out_BRQD
