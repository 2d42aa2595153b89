"""Token log-probabilities from final hidden states without materialising [tokens x vocab] at once.

Logits are formed for `chunk_size` tokens at a time, in the forward and again in the backward, which recomputes
them instead of keeping them: live logits memory is one chunk, whatever the length.

Legend: B batch, T tokens, N = B * T, C hidden, V vocab.
"""

from __future__ import annotations

import torch

from longstraw_kernels import compute_dtype


def _chunk_logits(h_NC: torch.Tensor, weight_VC: torch.Tensor) -> torch.Tensor:
    logits_NV = torch.nn.functional.linear(h_NC, weight_VC)
    return logits_NV.to(compute_dtype(logits_NV.dtype))


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward: logits chunk by chunk, keeping each token's lse. Backward: each chunk's logits are recomputed
    and its weight gradient is added into ONE [V, C] buffer, so the backward holds one chunk of logits and one
    weight-sized gradient, never one per chunk. Saved: the hidden states, the targets and the lse (the weight is
    a parameter, saved by reference)."""

    @staticmethod
    def forward(ctx, h_NC, weight_VC, targets, chunk_size):
        dtype = compute_dtype(h_NC.dtype)
        targets_N = targets.reshape(-1)
        # allocated in the targets' shape and returned as it is: a caller gets a tensor of its own, not a view
        # (FSDP2 hooks the output of a wrapped module for its backward and warns on views)
        logp = torch.empty(targets.shape, dtype=dtype, device=h_NC.device)
        logp_N = logp.view(-1)
        lse_N = torch.empty_like(logp_N)
        for start in range(0, h_NC.shape[0], chunk_size):
            end = start + chunk_size
            logits_NV = _chunk_logits(h_NC[start:end], weight_VC)
            lse_N[start:end] = torch.logsumexp(logits_NV, dim=-1)
            logp_N[start:end] = logits_NV.gather(-1, targets_N[start:end, None])[:, 0] - lse_N[start:end]
            del logits_NV
        ctx.save_for_backward(h_NC, weight_VC, targets_N, lse_N)
        ctx.chunk_size = chunk_size
        return logp

    @staticmethod
    def backward(ctx, dlogp):
        h_NC, weight_VC, targets_N, lse_N = ctx.saved_tensors
        dlogp_N = dlogp.reshape(-1)
        need_h, need_w = ctx.needs_input_grad[:2]
        dh_NC = torch.empty_like(h_NC) if need_h else None
        dweight_VC = torch.zeros_like(weight_VC) if need_w else None
        for start in range(0, h_NC.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h, d = h_NC[start:end], dlogp_N[start:end, None]
            # d logp / d logits = onehot(target) - softmax, times the incoming gradient
            # in place: one fp32 chunk of logits at a time
            g_NV = _chunk_logits(h, weight_VC).sub_(lse_N[start:end, None]).exp_().mul_(-d)
            g_NV.scatter_add_(1, targets_N[start:end, None], d)
            g_NV = g_NV.to(weight_VC.dtype)
            if need_h:
                dh_NC[start:end] = g_NV @ weight_VC
            if need_w:
                dweight_VC.addmm_(g_NV.t(), h)
            del g_NV
        return dh_NC, dweight_VC, None, None


def token_logprobs(
    h_BTC: torch.Tensor, weight_VC: torch.Tensor, targets: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """log softmax(h W^T)[target] per token, shaped like `targets` ([B, T], or [T] for one response: h then
    [1, T, C]), in fp32 (fp64 for fp64 inputs). Chunks run over the flattened batch x tokens, so a batch of
    responses costs no more logits memory than one."""
    if targets.numel() == 0:
        return h_BTC.new_zeros(targets.shape, dtype=compute_dtype(h_BTC.dtype))
    h_NC = h_BTC.reshape(targets.numel(), -1)
    return _ChunkedLogprobs.apply(h_NC, weight_VC, targets, chunk_size)
