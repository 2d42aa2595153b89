"""replay_attention for any device: flash attention's forward on CUDA in bf16/fp16 where its masks fit, the
torch reference everywhere else (CPU, fp32/fp64, other shapes). Same signature, same saved-tensor contract."""

from longstraw_kernels.attention import reference
from longstraw_kernels.attention.flash import _FlashReplayAttention, flash_replay_attention_backward, flash_supported


def replay_attention(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, *, scale, block_size=1024,
                     return_lse=False):
    """-> out_BRQD [, lse_BQR]; see `reference.replay_attention`."""
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
