"""replay_attention for any device: flash attention's forward on CUDA in bf16/fp16 where its masks fit, the
torch reference everywhere else (CPU, fp32/fp64, other shapes). Same signature, same saved-tensor contract."""

import functools

import torch

from longstraw_kernels.attention import reference
from longstraw_kernels.attention.flash import _FlashReplayAttention, flash_replay_attention_backward, flash_supported


def replay_attention(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, *, scale, block_size=1024,
                     return_lse=False):
    """-> out_BRQD [, lse_BQR]; see `reference.replay_attention`."""
    R, S = q_BRQD.shape[1], k_new_BSKD.shape[1]
    if S > R > 1 and flash_supported(q_BRQD, k_pages_PKD, k_new_BSKD[:, S - R :]):
        # a block of a response after earlier blocks (blockwise replay): flash takes the two parts apart
        return split_new_keys(replay_attention, replay_attention_backward, q_BRQD, k_pages_PKD, v_pages_PKD,
                              k_new_BSKD, v_new_BSKD, scale=scale, block_size=block_size, return_lse=return_lse)
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


def split_new_keys(attention, attention_backward, q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, *,
                   scale, block_size=1024, return_lse=False):
    """The same attention when the R queries are the last R of S > R new keys (a response block after earlier
    blocks): `attention` over the pages plus the last R new keys (causal, S == R), and over each sequence's
    earlier S - R keys, which every query sees (no mask: they take the pages' place, S == 0), merged by LSE. Both
    calls are ones flash attention serves, and so are their backwards: `attention_backward` (the same kernels'
    backward, `replay_attention_backward`'s contract) runs once per part from the MERGED out and lse, the
    ring-attention identity, so no lse cotangent reaches a kernel that has none."""
    out_BRQD, lse_BQR = _SplitNewKeys.apply(attention, attention_backward, q_BRQD, k_pages_PKD, v_pages_PKD,
                                            k_new_BSKD, v_new_BSKD, scale, block_size)
    return (out_BRQD, lse_BQR) if return_lse else out_BRQD


class _SplitNewKeys(torch.autograd.Function):
    """split_new_keys as one differentiable attention. A merge differentiated through its LSE weights would send
    an lse cotangent into both calls, which aten's flash backward cannot take (it would fall back to the fp32
    reference: measured on an H200, 0.5 of a 1.3 s blockwise replay in fp32 matmuls)."""

    @staticmethod
    def forward(ctx, attention, attention_backward, q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD,
                scale, block_size):
        R, S = q_BRQD.shape[1], k_new_BSKD.shape[1]
        out_a, lse_a = attention(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD[:, S - R :], v_new_BSKD[:, S - R :],
                                 scale=scale, block_size=block_size, return_lse=True)
        none_BSKD = k_new_BSKD[:1, :0]
        parts = [attention(q_BRQD[b : b + 1], k_new_BSKD[b, : S - R], v_new_BSKD[b, : S - R], none_BSKD, none_BSKD,
                           scale=scale, block_size=block_size, return_lse=True) for b in range(q_BRQD.shape[0])]
        out_b = torch.cat([o for o, _ in parts])
        lse_b = torch.cat([lse for _, lse in parts])
        lse_BQR = torch.logaddexp(lse_a, lse_b)
        # [B, Q, R] weights onto [B, R, Q, 1]
        w_a, w_b = ((lse - lse_BQR).exp().transpose(1, 2)[..., None] for lse in (lse_a, lse_b))
        out_BRQD = (w_a * out_a.to(w_a.dtype) + w_b * out_b.to(w_b.dtype)).to(q_BRQD.dtype)
        ctx.attention_backward, ctx.scale, ctx.block_size = attention_backward, scale, block_size
        ctx.save_for_backward(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR)
        # an unused lse must reach the backward as None, not as zeros (which would send it to the reference)
        ctx.set_materialize_grads(False)
        return out_BRQD, lse_BQR

    @staticmethod
    def backward(ctx, dout_BRQD, dlse_BQR):
        q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR = ctx.saved_tensors
        need_q, need_kp, need_vp, need_kn, need_vn = ctx.needs_input_grad[2:7]
        backward = functools.partial(ctx.attention_backward, scale=ctx.scale, block_size=ctx.block_size)
        B, R, S = q_BRQD.shape[0], q_BRQD.shape[1], k_new_BSKD.shape[1]
        # the pages and the block's own keys, from the merged out and lse
        dq_a, dk_pages_PKD, dv_pages_PKD, dk_own, dv_own = backward(
            (q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD[:, S - R :], v_new_BSKD[:, S - R :], out_BRQD, lse_BQR),
            (need_q, need_kp, need_vp, need_kn, need_vn), dout_BRQD, dlse_BQR)
        # each sequence's earlier keys in the pages' place, from the same merged out and lse
        none_BSKD = k_new_BSKD[:1, :0]
        # dq summed over both parts in at least fp32
        wide = torch.promote_types(q_BRQD.dtype, torch.float32)
        dq_BRQD = dq_a.to(wide) if need_q else None
        dk_new_BSKD = torch.zeros_like(k_new_BSKD) if need_kn else None
        dv_new_BSKD = torch.zeros_like(v_new_BSKD) if need_vn else None
        for b in range(B):
            dq_b, dk_b, dv_b, _, _ = backward(
                (q_BRQD[b : b + 1], k_new_BSKD[b, : S - R], v_new_BSKD[b, : S - R], none_BSKD, none_BSKD,
                 out_BRQD[b : b + 1], lse_BQR[b : b + 1]),
                (need_q, need_kn, need_vn, False, False), None if dout_BRQD is None else dout_BRQD[b : b + 1],
                None if dlse_BQR is None else dlse_BQR[b : b + 1])
            if need_q:
                dq_BRQD[b : b + 1] += dq_b.to(wide)
            if need_kn:
                dk_new_BSKD[b, : S - R] = dk_b
            if need_vn:
                dv_new_BSKD[b, : S - R] = dv_b
        if need_kn:
            dk_new_BSKD[:, S - R :] = dk_own
        if need_vn:
            dv_new_BSKD[:, S - R :] = dv_own
        dq_BRQD = None if dq_BRQD is None else dq_BRQD.to(q_BRQD.dtype)
        return None, None, dq_BRQD, dk_pages_PKD, dv_pages_PKD, dk_new_BSKD, dv_new_BSKD, None, None
