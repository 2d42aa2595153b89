"""Context-parallel attention: each rank of the CP group owns a contiguous shard of the prompt's pages.

Rank 0 holds the first tokens, rank N-1 the last; shard sizes may differ, even be 0. Both functions build on
`replay_attention` and merge partial results by log-sum-exp, so CP=N reproduces CP=1 up to rounding.

- `cp_replay_attention` (replay, scoring): the response is replicated on every rank. Each rank attends to its
  own pages (a partial with its lse), the partials are merged across ranks, then merged with the response's
  causal part; q keeps its dtype, so on GPU in bf16 the flash kernels run forward and backward (the backward
  from the global out and lse, the ring identity). Gradients w.r.t. q, k_new, v_new equal CP=1 on every rank.
- `cp_decode_pages_attention` (native decode): one query token per response against this rank's pages, the
  partials gathered and merged.
- `cp_capture_attention` (prompt capture, no grad): a rank's queries attend to every page of the lower ranks
  and to their own keys causally. K/V shards go around the ring one hop per step (ring attention).

What it simplifies: contiguous shards only (no zigzag load balancing, so in capture rank N-1 does the most
work); replay's collectives block (only capture overlaps a ring hop with compute).

Shape legend:
    B  batch (responses)     R  queries per response     S  new (response) keys per response
    P  this rank's pages     T  this rank's prompt tokens in capture     N  ranks in the CP group
    Q  query heads           K  kv heads                 D  head dim
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longstraw_kernels import compute_dtype
from longstraw_kernels.attention import replay_attention
from longstraw_kernels.attention.decode import decode_pages_attention, merge_partials
from longstraw_kernels.attention.dispatch import replay_attention_backward

__all__ = ["cp_replay_attention", "cp_capture_attention", "cp_decode_pages_attention"]


def _weight_BRQ1(lse_part_BQR: torch.Tensor, lse_BQR: torch.Tensor) -> torch.Tensor:
    """exp(lse_part - lse) laid out to scale an out [B, R, Q, D]."""
    return torch.exp(lse_part_BQR - lse_BQR).transpose(1, 2)[..., None]


def _merge(out_a_BRQD, lse_a_BQR, out_b_BRQD, lse_b_BQR):
    """Differentiable LSE merge of two partials over disjoint keys. At most one lse may be -inf per row."""
    lse_BQR = torch.logaddexp(lse_a_BQR, lse_b_BQR)
    out_BRQD = _weight_BRQ1(lse_a_BQR, lse_BQR) * out_a_BRQD + _weight_BRQ1(lse_b_BQR, lse_BQR) * out_b_BRQD
    return out_BRQD, lse_BQR


def merge_across_ranks(out_r_BRQD, lse_r_BQR, group):
    """This rank's partial (out_r, lse_r) -> the LSE merge over all ranks' partials, identical on every rank:
    an all-gather of the lse (small), then an all-reduce of the weighted outs (one partial held, not N)."""
    lse_list = [torch.empty_like(lse_r_BQR) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lse_list, lse_r_BQR.contiguous(), group=group)
    lse_NBQR = torch.stack(lse_list)
    # With no pages on any rank lse is -inf; clamping it keeps the weights 0 instead of NaN.
    lse_BQR = torch.logsumexp(lse_NBQR, dim=0).clamp_min(torch.finfo(lse_NBQR.dtype).min)
    # contiguous: the broadcast product may take the transposed weight's layout, which NCCL refuses
    out_BRQD = (_weight_BRQ1(lse_r_BQR, lse_BQR) * out_r_BRQD).contiguous()
    dist.all_reduce(out_BRQD, group=group)
    return out_BRQD, lse_BQR


class AllReduceGrad(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group.

    Every rank's pages contribute to dq, and each rank only computes its own pages' share."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # A copy: the incoming gradient buffer may be shared with other consumers.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class MergeAcrossRanks(torch.autograd.Function):
    """This rank's page partial (out_r, lse_r) -> the merge over all ranks' pages, identical on every rank.

    Forward: all-gather the lse (small), then all-reduce the weighted outs; only one [B, R, Q, D] partial
    is held, not N. Backward needs no collective: every rank receives the same upstream gradient (the loss
    is replicated), and the gradient of this rank's partial follows from the merged (out, lse) alone:
    with w_r = exp(lse_r - lse), d out_r = w_r dout and d lse_r = w_r (dlse + <dout, out_r - out>).
    """

    @staticmethod
    def forward(ctx, out_r_BRQD, lse_r_BQR, group):
        out_BRQD, lse_BQR = merge_across_ranks(out_r_BRQD, lse_r_BQR, group)
        ctx.save_for_backward(out_r_BRQD, lse_r_BQR, out_BRQD, lse_BQR)
        return out_BRQD, lse_BQR

    @staticmethod
    def backward(ctx, dout_BRQD, dlse_BQR):
        out_r_BRQD, lse_r_BQR, out_BRQD, lse_BQR = ctx.saved_tensors
        w_BRQ1 = _weight_BRQ1(lse_r_BQR, lse_BQR)
        dot_BQR = (dout_BRQD * (out_r_BRQD - out_BRQD)).sum(-1).transpose(1, 2)
        return w_BRQ1 * dout_BRQD, w_BRQ1[..., 0].transpose(1, 2) * (dlse_BQR + dot_BQR), None


def _page_partial(q_BRQD, k_pages_PKD, v_pages_PKD, *, scale, block_size):
    """(out, lse) of the queries against this rank's pages only."""
    B, R, Q, D = q_BRQD.shape
    P, K = k_pages_PKD.shape[:2]
    if P == 0:
        # An empty partial (0, -inf). It is still computed from q so that this rank's backward reaches the
        # all-reduce of dq, in which every other rank waits.
        return q_BRQD * 0, q_BRQD.new_full((B, Q, R), float("-inf"))
    no_keys_BSKD = q_BRQD.new_empty((B, 0, K, D))
    return replay_attention(
        q_BRQD, k_pages_PKD, v_pages_PKD, no_keys_BSKD, no_keys_BSKD,
        scale=scale, block_size=block_size, return_lse=True,
    )


class _CPReplayAttention(torch.autograd.Function):
    """Replay attention over every rank's pages plus the (replicated) response keys, q in its own dtype (the
    flash kernel on GPU in bf16). Forward: this rank's page partial, merged across ranks, merged with the
    response's causal part. Backward, the ring-attention identity: each part's gradient follows from the GLOBAL
    out and lse, so this rank's pages give its share of dq (summed over ranks by one all-reduce) and its own
    shard's page gradients, and the response part, computed the same on every rank, gives dq, dk_new, dv_new
    once, without a collective. No lse cotangent ever reaches a kernel, so the flash backward serves too."""

    @staticmethod
    def forward(ctx, q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, scale, block_size, group):
        with torch.no_grad():
            out_r_BRQD, lse_r_BQR = _page_partial(q_BRQD, k_pages_PKD, v_pages_PKD, scale=scale,
                                                  block_size=block_size)
            out_p_BRQD, lse_p_BQR = merge_across_ranks(out_r_BRQD.to(lse_r_BQR.dtype), lse_r_BQR, group)
            no_pages_PKD = k_new_BSKD.new_empty((0, *k_new_BSKD.shape[2:]))
            out_n_BRQD, lse_n_BQR = replay_attention(q_BRQD, no_pages_PKD, no_pages_PKD, k_new_BSKD, v_new_BSKD,
                                                     scale=scale, block_size=block_size, return_lse=True)
            out_BRQD, lse_BQR = _merge(out_p_BRQD, lse_p_BQR, out_n_BRQD, lse_n_BQR)
        out_BRQD = out_BRQD.to(q_BRQD.dtype)
        ctx.save_for_backward(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR)
        ctx.scale, ctx.block_size, ctx.group = scale, block_size, group
        return out_BRQD

    @staticmethod
    def backward(ctx, dout_BRQD):
        q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR = ctx.saved_tensors
        _, need_kp, need_vp, need_kn, need_vn = ctx.needs_input_grad[:5]
        no_pages_PKD = k_new_BSKD.new_empty((0, *k_new_BSKD.shape[2:]))
        no_keys_BSKD = k_new_BSKD[:, :0]
        kwargs = dict(scale=ctx.scale, block_size=ctx.block_size)
        dq_p_BRQD, dk_pages_PKD, dv_pages_PKD, _, _ = replay_attention_backward(
            (q_BRQD, k_pages_PKD, v_pages_PKD, no_keys_BSKD, no_keys_BSKD, out_BRQD, lse_BQR),
            (True, need_kp, need_vp, False, False), dout_BRQD, None, **kwargs)
        dq_p_BRQD = dq_p_BRQD.to(lse_BQR.dtype).contiguous()
        dist.all_reduce(dq_p_BRQD, group=ctx.group)
        dq_n_BRQD, _, _, dk_new_BSKD, dv_new_BSKD = replay_attention_backward(
            (q_BRQD, no_pages_PKD, no_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR),
            (True, False, False, need_kn, need_vn), dout_BRQD, None, **kwargs)
        dq_BRQD = (dq_p_BRQD + dq_n_BRQD.to(lse_BQR.dtype)).to(q_BRQD.dtype)
        return dq_BRQD, dk_pages_PKD, dv_pages_PKD, dk_new_BSKD, dv_new_BSKD, None, None, None


def cp_replay_attention(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, *, scale, group=None,
                        block_size=1024):
    """-> out_BRQD (q's dtype), the same on every rank: `replay_attention` over all ranks' pages in rank order.

    q, k_new, v_new must be identical on every rank, and so must the loss backpropagated through the output:
    then every rank gets the CP=1 gradients for q, k_new, v_new (and its own shard's page gradients).
    """
    return _CPReplayAttention.apply(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, scale, block_size,
                                    group)


def cp_decode_pages_attention(q_BQD, k_pages_PKD, v_pages_PKD, *, scale, group=None):
    """`decode_pages_attention` over every rank's pages: each rank's partial (its own shard, q in its own dtype,
    so the flash kernel runs), one all-gather of (out | lse) packed in fp32 (B*Q*(D+1) values: 131 KB a layer at
    G=8, Q=16, D=256), merged in rank order. -> (out_BQD, lse_BQ), identical on every rank."""
    out_BQD, lse_BQ = decode_pages_attention(q_BQD, k_pages_PKD, v_pages_PKD, scale=scale)
    packed_BQX = torch.cat([out_BQD.to(lse_BQ.dtype), lse_BQ[..., None]], dim=-1).contiguous()
    gathered = [torch.empty_like(packed_BQX) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed_BQX, group=group)
    packed_NBQX = torch.stack(gathered)
    return merge_partials(packed_NBQX[..., :-1], packed_NBQX[..., -1], q_BQD.dtype)


def _attend_shard_(out_BTQD, lse_BQT, q_BTQD, k_PKD, v_PKD, *, own, scale, block_size):
    """Merges the queries' attention to one shard into the running (out, lse), a query block at a time.

    Blocks keep the scores at [block, block] per head. own=True: the shard is the queries' own, so block
    [t0, t1) sees keys [0, t0) as pages and [t0, t1) causally; otherwise it sees every key of the shard.
    """
    T = q_BTQD.shape[1]
    no_keys_BSKD = k_PKD.new_empty((1, 0, *k_PKD.shape[1:]))
    for t0 in range(0, T, block_size):
        t1 = min(t0 + block_size, T)
        # q stays in its own dtype: a bf16 q takes the fused kernel (fp32 q against bf16 pages would fall back to
        # the torch reference, 10x slower at 256K on two H200s); partials merge in the compute dtype
        q_blk_BTQD = q_BTQD[:, t0:t1]
        if own:
            keys = (k_PKD[:t0], v_PKD[:t0], k_PKD[None, t0:t1], v_PKD[None, t0:t1])
        else:
            keys = (k_PKD, v_PKD, no_keys_BSKD, no_keys_BSKD)
        o_BTQD, l_BQT = replay_attention(q_blk_BTQD, *keys, scale=scale, block_size=block_size, return_lse=True)
        out_BTQD[:, t0:t1], lse_BQT[..., t0:t1] = _merge(out_BTQD[:, t0:t1], lse_BQT[..., t0:t1], o_BTQD, l_BQT)


def _ring_step(k_PKD, v_PKD, recv_tokens, group, rank, num_ranks):
    """Starts sending (k, v) to the next rank and receiving the previous rank's into new buffers."""
    k_next_PKD = k_PKD.new_empty((recv_tokens, *k_PKD.shape[1:]))
    v_next_PKD = v_PKD.new_empty((recv_tokens, *v_PKD.shape[1:]))
    send_to = dist.get_global_rank(group, (rank + 1) % num_ranks)
    recv_from = dist.get_global_rank(group, (rank - 1) % num_ranks)
    ops = []
    # Both ends know every shard's size, so both skip empty shards.
    if recv_tokens:
        ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in (k_next_PKD, v_next_PKD)]
    if k_PKD.shape[0]:
        ops += [dist.P2POp(dist.isend, t, send_to, group) for t in (k_PKD, v_PKD)]
    return k_next_PKD, v_next_PKD, (dist.batch_isend_irecv(ops) if ops else [])


@torch.no_grad()
def cp_capture_attention(q_BTQD, k_local_TKD, v_local_TKD, *, scale, group=None, block_size=1024):
    """-> out_BTQD (q's dtype, B == 1): the local shard's queries against every earlier prompt token.

    Equals single-rank causal attention over the whole prompt, restricted to this rank's rows. Each rank holds
    its own shard plus at most one remote shard (and one in flight).
    """
    if q_BTQD.shape[0] != 1 or q_BTQD.shape[1] != k_local_TKD.shape[0]:
        raise ValueError(f"capture needs q [1, T, Q, D] and k [T, K, D]; got q {tuple(q_BTQD.shape)}, "
                         f"k {tuple(k_local_TKD.shape)}")
    group = group or dist.group.WORLD
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    # On the keys' device: NCCL only moves GPU tensors.
    tokens = torch.tensor(k_local_TKD.shape[0], device=k_local_TKD.device)
    tokens_list = [torch.empty_like(tokens) for _ in range(num_ranks)]
    dist.all_gather(tokens_list, tokens, group=group)

    _, T, Q, D = q_BTQD.shape
    dtype = compute_dtype(q_BTQD.dtype)
    out_BTQD = q_BTQD.new_zeros((1, T, Q, D), dtype=dtype)
    lse_BQT = q_BTQD.new_full((1, Q, T), float("-inf"), dtype=dtype)
    # Sent buffers must be contiguous; received ones are, and are sent on as they are.
    k_PKD, v_PKD = k_local_TKD.contiguous(), v_local_TKD.contiguous()
    # After step s a rank holds the shard of rank - s; those of lower ranks are attended, those of higher
    # ranks (wrapped around the ring) are only passed on. The own shard is attended while the first hop flies.
    for step in range(num_ranks):
        source = (rank - step) % num_ranks
        if step + 1 < num_ranks:
            recv_tokens = int(tokens_list[(rank - step - 1) % num_ranks])
            k_next_PKD, v_next_PKD, reqs = _ring_step(k_PKD, v_PKD, recv_tokens, group, rank, num_ranks)
        if source <= rank and k_PKD.shape[0] > 0:
            _attend_shard_(out_BTQD, lse_BQT, q_BTQD, k_PKD, v_PKD, own=source == rank, scale=scale,
                           block_size=block_size)
        if step + 1 < num_ranks:
            for req in reqs:
                req.wait()
            k_PKD, v_PKD = k_next_PKD, v_next_PKD
    return out_BTQD.to(q_BTQD.dtype)
