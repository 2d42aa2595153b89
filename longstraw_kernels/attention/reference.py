"""Replay attention in plain torch: the CPU reference that GPU kernels are tested against.

One op serves prompt capture (a block of prompt queries against earlier pages plus its own causal keys),
response scoring and replay (response queries against the whole prompt plus causal response keys) and
batched decode (one query per sequence against the generated keys). Queries see every prompt page (no mask)
and the new keys causally, bottom-right aligned. Pages are processed in blocks of `block_size` tokens and
merged by log-sum-exp, so score memory is bounded by the block, not by the prompt; the backward recomputes
each block from the global out and lse, as ring attention does (derivation in README.md beside this file).

What it simplifies: no dropout, sliding window, softcap or attention sinks; pages are shared by the whole
batch (one prompt); the compute is unfused matmuls in float32 (float64 when an input is float64). Pages may live
in host memory while q is on a GPU (qwen36's offloaded replay under autograd): each block of pages is copied to
q's device when read, in the forward and again in the backward, so no whole layer of pages is kept on the device.

Shape legend:
    B  batch (sequences)            R  queries per sequence
    S  new keys per sequence (S >= R, query i sees new key j iff j <= i + S - R; or S == 0: pages only)
    P  prompt pages (tokens)        N  pages in one block
    Q  query heads                  K  kv heads (query head h uses kv head h // G)
    G  query heads per kv head      M  G * R: a kv group's query heads folded into the query axis
    D  head dim
"""

import torch

from longstraw_kernels import compute_dtype

__all__ = ["replay_attention", "replay_attention_backward", "naive_attention"]


def _fold_heads(x_BRQD: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, R, Q, D] -> [B, K, G*R, D]: the G query heads of a kv group become extra query rows."""
    B, R, Q, D = x_BRQD.shape
    x_BQRD = x_BRQD.to(dtype).transpose(1, 2)
    return x_BQRD.reshape(B, num_kv_heads, (Q // num_kv_heads) * R, D)


def _unfold_heads(x_BKMD: torch.Tensor, num_queries: int) -> torch.Tensor:
    """[B, K, G*R, D] -> [B, R, Q, D], the inverse of _fold_heads."""
    B, K, M, D = x_BKMD.shape
    x_BQRD = x_BKMD.reshape(B, K * (M // num_queries), num_queries, D)
    return x_BQRD.transpose(1, 2).contiguous()


def _causal_mask_MS(R: int, S: int, G: int, device: torch.device) -> torch.Tensor:
    # Folded row m is query position m % R of some head in the group; the mask depends on the position only.
    pos_M = torch.arange(R, device=device).repeat(G)
    return torch.arange(S, device=device)[None, :] <= pos_M[:, None] + (S - R)


def _new_key_scores(qs_BKMD, k_new_BSKD, mask_MS):
    k_BKSD = k_new_BSKD.to(qs_BKMD.dtype).transpose(1, 2)
    scores_BKMS = qs_BKMD @ k_BKSD.transpose(-1, -2)
    return scores_BKMS.masked_fill(~mask_MS, float("-inf")), k_BKSD


def _page_scores(qs_BKMD, k_NKD):
    # The pages are shared by the batch: [K, D, N] broadcasts against [B, K, M, D] with no copy per batch.
    # Pages held in host memory (offloaded) cross to the queries' device one block at a time.
    k_KND = k_NKD.to(qs_BKMD.device, qs_BKMD.dtype).transpose(0, 1)
    return qs_BKMD @ k_KND.transpose(-1, -2), k_KND


class _ReplayAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, scale, block_size):
        B, R, Q, D = q_BRQD.shape
        P, K = k_pages_PKD.shape[:2]
        S = k_new_BSKD.shape[1]
        dtype = compute_dtype(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD)
        # Scaling q once costs one pass over the queries instead of one pass per block of scores.
        qs_BKMD = _fold_heads(q_BRQD, K, dtype) * scale

        # The new-key block goes first: S >= R, so every row sees at least one new key and its lse is finite,
        # which keeps the running lse finite for P == 0 and for every merge after it. With S == 0 (pages only,
        # so P > 0) the block is empty: lse -inf and out 0, which the first page block's merge replaces exactly.
        mask_MS = _causal_mask_MS(R, S, Q // K, q_BRQD.device)
        scores_BKMS, _ = _new_key_scores(qs_BKMD, k_new_BSKD, mask_MS)
        lse_BKM = torch.logsumexp(scores_BKMS, dim=-1)
        v_BKSD = v_new_BSKD.to(dtype).transpose(1, 2)
        out_BKMD = torch.exp(scores_BKMS - lse_BKM[..., None]) @ v_BKSD
        del scores_BKMS

        for p0 in range(0, P, block_size):
            scores_BKMN, _ = _page_scores(qs_BKMD, k_pages_PKD[p0 : p0 + block_size])
            lse_blk_BKM = torch.logsumexp(scores_BKMN, dim=-1)
            v_KND = v_pages_PKD[p0 : p0 + block_size].to(q_BRQD.device, dtype).transpose(0, 1)
            out_blk_BKMD = torch.exp(scores_BKMN - lse_blk_BKM[..., None]) @ v_KND
            new_lse_BKM = torch.logaddexp(lse_BKM, lse_blk_BKM)
            out_BKMD = (
                torch.exp(lse_BKM - new_lse_BKM)[..., None] * out_BKMD
                + torch.exp(lse_blk_BKM - new_lse_BKM)[..., None] * out_blk_BKMD
            )
            lse_BKM = new_lse_BKM

        out_BRQD = _unfold_heads(out_BKMD, R).to(q_BRQD.dtype)
        lse_BQR = lse_BKM.reshape(B, Q, R)
        save_for_replay_backward(ctx, (q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR),
                                 scale, block_size, replay_attention_backward)
        return out_BRQD, lse_BQR

    @staticmethod
    def backward(ctx, dout_BRQD, dlse_BQR):
        return (*ctx.backward_fn(ctx.saved_tensors, ctx.needs_input_grad[:5], dout_BRQD, dlse_BQR,
                                 scale=ctx.scale, block_size=ctx.block_size), None, None)


def save_for_replay_backward(ctx, saved, scale, block_size, backward_fn) -> None:
    """What every replay-attention Function keeps for its backward: (q, k_pages, v_pages, k_new, v_new, out, lse)
    and the backward that reads them. Pages are saved by reference: they are the resident state, a copy would
    double it."""
    ctx.save_for_backward(*saved)
    ctx.scale, ctx.block_size, ctx.backward_fn = scale, block_size, backward_fn
    ctx.set_materialize_grads(False)


def replay_attention_backward(saved, needs_grad, dout_BRQD, dlse_BQR, *, scale, block_size):
    """Gradients (dq, dk_pages, dv_pages, dk_new, dv_new; None where `needs_grad` is False) from what the
    forward saved: (q, k_pages, v_pages, k_new, v_new, out, lse). With a GLOBAL out and lse (the merge of this
    call's keys with others': context-parallel shards) the result is this call's part of the gradient, the
    ring-attention identity (README.md)."""
    q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR = saved
    need_q, need_kp, need_vp, need_kn, need_vn = needs_grad
    B, R, Q, D = q_BRQD.shape
    P, K = k_pages_PKD.shape[:2]
    S = k_new_BSKD.shape[1]
    dtype = lse_BQR.dtype
    if dout_BRQD is None:
        dout_BRQD = torch.zeros_like(out_BRQD)

    qs_BKMD = _fold_heads(q_BRQD, K, dtype) * scale
    do_BKMD = _fold_heads(dout_BRQD, K, dtype)
    lse_BKM = lse_BQR.reshape(B, K, -1)
    # dS = P * (dP - delta) with delta = rowsum(dO * O) - dlse; the dlse term is the lse's own gradient.
    delta_BKM = (do_BKMD * _fold_heads(out_BRQD, K, dtype)).sum(-1)
    if dlse_BQR is not None:
        delta_BKM = delta_BKM - dlse_BQR.to(dtype).reshape(B, K, -1)
    dq_BKMD = torch.zeros_like(qs_BKMD) if need_q else None

    mask_MS = _causal_mask_MS(R, S, Q // K, q_BRQD.device)
    scores_BKMS, k_BKSD = _new_key_scores(qs_BKMD, k_new_BSKD, mask_MS)
    v_BKSD = v_new_BSKD.to(dtype).transpose(1, 2)
    p_BKMS = torch.exp(scores_BKMS - lse_BKM[..., None])
    ds_BKMS = p_BKMS * (do_BKMD @ v_BKSD.transpose(-1, -2) - delta_BKM[..., None])
    del scores_BKMS
    if need_q:
        dq_BKMD += ds_BKMS @ k_BKSD
    # Folding made the sum over a group's query heads part of the matmul: no separate GQA reduction.
    dk_new_BSKD = (ds_BKMS.transpose(-1, -2) @ qs_BKMD).transpose(1, 2).to(k_new_BSKD.dtype) if need_kn else None
    dv_new_BSKD = (p_BKMS.transpose(-1, -2) @ do_BKMD).transpose(1, 2).to(v_new_BSKD.dtype) if need_vn else None
    del p_BKMS, ds_BKMS

    # A page block's gradient is complete within the block (summed over batch and queries), so it is
    # written straight into a buffer of the pages' dtype: no float32 copy of the whole prompt.
    dk_pages_PKD = torch.empty_like(k_pages_PKD) if need_kp else None
    dv_pages_PKD = torch.empty_like(v_pages_PKD) if need_vp else None
    if need_q or need_kp or need_vp:
        for p0 in range(0, P, block_size):
            p1 = min(p0 + block_size, P)
            scores_BKMN, k_KND = _page_scores(qs_BKMD, k_pages_PKD[p0:p1])
            p_BKMN = torch.exp(scores_BKMN - lse_BKM[..., None])
            del scores_BKMN
            if need_vp:
                dv_pages_PKD[p0:p1] = torch.einsum("bkmn,bkmd->nkd", p_BKMN, do_BKMD)
            if not (need_q or need_kp):
                continue
            v_KND = v_pages_PKD[p0:p1].to(q_BRQD.device, dtype).transpose(0, 1)
            ds_BKMN = p_BKMN * (do_BKMD @ v_KND.transpose(-1, -2) - delta_BKM[..., None])
            if need_q:
                dq_BKMD += ds_BKMN @ k_KND
            if need_kp:
                dk_pages_PKD[p0:p1] = torch.einsum("bkmn,bkmd->nkd", ds_BKMN, qs_BKMD)

    dq_BRQD = _unfold_heads(dq_BKMD * scale, R).to(q_BRQD.dtype) if need_q else None
    return dq_BRQD, dk_pages_PKD, dv_pages_PKD, dk_new_BSKD, dv_new_BSKD


def _check_shapes(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, block_size):
    if q_BRQD.dim() != 4 or k_new_BSKD.dim() != 4 or k_pages_PKD.dim() != 3:
        raise ValueError(
            f"expected q [B, R, Q, D], pages [P, K, D], new keys [B, S, K, D]; got q {tuple(q_BRQD.shape)}, "
            f"pages {tuple(k_pages_PKD.shape)}, new keys {tuple(k_new_BSKD.shape)}"
        )
    B, R, Q, D = q_BRQD.shape
    _, S, K, _ = k_new_BSKD.shape
    if k_pages_PKD.shape != v_pages_PKD.shape or k_pages_PKD.shape[1:] != (K, D):
        raise ValueError(
            f"pages k {tuple(k_pages_PKD.shape)} / v {tuple(v_pages_PKD.shape)} must both be [P, {K}, {D}]"
        )
    if k_new_BSKD.shape != v_new_BSKD.shape or k_new_BSKD.shape[0] != B or k_new_BSKD.shape[3] != D:
        raise ValueError(f"new k {tuple(k_new_BSKD.shape)} / v {tuple(v_new_BSKD.shape)} must both be [{B}, S, K, {D}]")
    if Q % K != 0:
        raise ValueError(f"query heads ({Q}) must be a multiple of kv heads ({K})")
    if S == 0 and k_pages_PKD.shape[0] == 0:
        raise ValueError("no keys to attend: need prompt pages (P > 0) or new keys (S > 0); got P=0, S=0")
    if 0 < S < R:
        raise ValueError(
            f"need at least as many new keys as queries (bottom-right causal) or none (S=0); got S={S} < R={R}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def replay_attention(
    q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, *, scale, block_size=1024, return_lse=False
):
    """-> out_BRQD (q's dtype) [, lse_BQR float32, float64 when an input is float64].

    Queries attend to every page (shared by the batch, no mask) and causally to the new keys; with S == 0
    they see the pages only (a partial result, e.g. one context-parallel shard). The lse is differentiable,
    so partial results can be merged by LSE outside (context parallelism) with autograd.
    """
    _check_shapes(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, block_size)
    out_BRQD, lse_BQR = _ReplayAttention.apply(
        q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, scale, block_size
    )
    return (out_BRQD, lse_BQR) if return_lse else out_BRQD


def naive_attention(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, *, scale):
    """Test oracle: concatenates pages and new keys, explicit mask, softmax; plain autograd. -> (out, lse)."""
    _check_shapes(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, 1)
    B, R, Q, D = q_BRQD.shape
    P, K = k_pages_PKD.shape[:2]
    S = k_new_BSKD.shape[1]
    dtype = compute_dtype(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD)
    k_BTKD = torch.cat([k_pages_PKD.to(dtype).expand(B, P, K, D), k_new_BSKD.to(dtype)], dim=1)
    v_BTKD = torch.cat([v_pages_PKD.to(dtype).expand(B, P, K, D), v_new_BSKD.to(dtype)], dim=1)
    k_BQTD = k_BTKD.repeat_interleave(Q // K, dim=2).transpose(1, 2)
    v_BQTD = v_BTKD.repeat_interleave(Q // K, dim=2).transpose(1, 2)
    scores_BQRT = (q_BRQD.to(dtype).transpose(1, 2) @ k_BQTD.transpose(-1, -2)) * scale
    i_R1 = torch.arange(R, device=q_BRQD.device)[:, None]
    j_1T = torch.arange(P + S, device=q_BRQD.device)[None, :]
    visible_RT = (j_1T < P) | (j_1T - P <= i_R1 + (S - R))
    scores_BQRT = scores_BQRT.masked_fill(~visible_RT, float("-inf"))
    lse_BQR = torch.logsumexp(scores_BQRT, dim=-1)
    out_BQRD = torch.softmax(scores_BQRT, dim=-1) @ v_BQTD
    return out_BQRD.transpose(1, 2).to(q_BRQD.dtype), lse_BQR
