"""Sparse absorbed-MLA attention in plain torch: the CPU reference for DSA replay (glm52).

Absorbed MLA: the key of page p is [latent_p (L) | rope_p (R)] and its value is latent_p (L); one key/value per
token is shared by all H query heads (kv_b is folded into the query and the output outside this op). Each query
row attends only to the pages its DSA top-k selected (`idx`, -1 = no entry), so the op gathers those pages.

`sparse_mla_attention` is an autograd Function that saves indices, q, out and lse (and the pages by reference:
they are the resident state) and recomputes the gathered pages chunk by chunk in backward, so no
[T, topk, L + R] gather is kept for backward. `dense_mla_attention` covers the few new keys (a response's own)
with a mask, in plain autograd; `merge_lse` combines two partial results (`sparse_mla_two_sources`: the decode's
prompt pages and response keys). `naive_sparse_mla_attention` is the
test oracle (gather everything, mask, softmax, plain autograd). Derivation in README.md.

What it simplifies: no dropout or softcap; pages are shared by the whole batch (one prompt); compute is unfused
gather + matmuls in float32 (float64 when an input is float64). Pages may live on another device than q (CPU
offload): selected rows are gathered there and moved, one chunk of queries at a time.

Shape legend:
    B batch   T queries per sequence   H query heads   K selected entries per query (top-k)
    P pages   S new keys per sequence  L latent dim (kv_lora_rank)   R rope dim   A = L + R
"""

from __future__ import annotations

import torch

from longstraw_kernels import compute_dtype

__all__ = ["sparse_mla_attention", "sparse_mla_backward", "check_shapes", "dense_mla_attention", "merge_lse",
           "naive_sparse_mla_attention", "own_slots", "sparse_mla_two_sources"]

# gathered entries (B * queries * K) per chunk: bounds the recomputed [chunk, K, A] tensor
_CHUNK_ENTRIES = 1 << 20


def _chunk_rows(B: int, T: int, K: int) -> int:
    return max(1, _CHUNK_ENTRIES // max(1, B * K))


def _gather(pages_PX: torch.Tensor, idx_BcK: torch.Tensor, device, dtype) -> torch.Tensor:
    """pages[idx] with -1 entries reading page 0 (masked later); gathered where the pages live, then moved."""
    safe = idx_BcK.clamp(min=0).to(pages_PX.device)
    return pages_PX[safe].to(device=device, dtype=dtype)


def _safe(lse: torch.Tensor) -> torch.Tensor:
    # rows with no entry have lse -inf; their probabilities must come out 0, not NaN
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _scores(q_BcHA, kv_BcKL, kr_BcKR, valid_BcK, scale):
    L = kv_BcKL.shape[-1]
    s = torch.einsum("bchl,bckl->bchk", q_BcHA[..., :L], kv_BcKL)
    s = s + torch.einsum("bchr,bckr->bchk", q_BcHA[..., L:], kr_BcKR)
    return (s * scale).masked_fill(~valid_BcK[:, :, None, :], float("-inf"))


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BTHA, latent_PL, rope_PR, idx_BTK, scale):
        B, T, H, A = q_BTHA.shape
        K = idx_BTK.shape[-1]
        dtype = compute_dtype(q_BTHA, latent_PL, rope_PR)
        out_BTHL = q_BTHA.new_empty(B, T, H, latent_PL.shape[-1], dtype=dtype)
        lse_BTH = q_BTHA.new_empty(B, T, H, dtype=dtype)
        step = _chunk_rows(B, T, K)
        for t0 in range(0, T, step):
            idx = idx_BTK[:, t0 : t0 + step]
            kv = _gather(latent_PL, idx, q_BTHA.device, dtype)
            kr = _gather(rope_PR, idx, q_BTHA.device, dtype)
            s = _scores(q_BTHA[:, t0 : t0 + step].to(dtype), kv, kr, idx >= 0, scale)
            lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - _safe(lse)[..., None])
            out_BTHL[:, t0 : t0 + step] = torch.einsum("bchk,bckl->bchl", p, kv)
            lse_BTH[:, t0 : t0 + step] = lse
        out_BTHL = out_BTHL.to(q_BTHA.dtype)
        # pages by reference: they are the resident state (possibly on CPU), a copy would double it
        ctx.save_for_backward(q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return out_BTHL, lse_BTH

    @staticmethod
    def backward(ctx, dout_BTHL, dlse_BTH):
        q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH = ctx.saved_tensors
        grads = sparse_mla_backward(q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH, dout_BTHL, dlse_BTH,
                                    ctx.scale, ctx.needs_input_grad[:3])
        return (*grads, None, None)


def sparse_mla_backward(q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH, dout_BTHL, dlse_BTH, scale,
                        needs_grad):
    """-> (dq, dlatent, drope), None where needs_grad (three bools) says no: the chunked recompute of README.md.
    Also the backward of the Triton forward whenever the pages need a gradient (triton_sparse.py)."""
    need_q, need_lat, need_rope = needs_grad
    B, T, H, A = q_BTHA.shape
    L = latent_PL.shape[-1]
    K = idx_BTK.shape[-1]
    dtype = lse_BTH.dtype
    if dout_BTHL is None:
        dout_BTHL = torch.zeros_like(out_BTHL)
    # dS = P * (dP - delta), delta = rowsum(dO * O) - dlse (README.md)
    delta_BTH = (dout_BTHL.to(dtype) * out_BTHL.to(dtype)).sum(-1)
    if dlse_BTH is not None:
        delta_BTH = delta_BTH - dlse_BTH.to(dtype)
    dq_BTHA = torch.zeros(B, T, H, A, dtype=dtype, device=q_BTHA.device) if need_q else None
    dlat_PL = torch.zeros(latent_PL.shape, dtype=dtype, device=q_BTHA.device) if need_lat else None
    drope_PR = torch.zeros(rope_PR.shape, dtype=dtype, device=q_BTHA.device) if need_rope else None
    step = _chunk_rows(B, T, K)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        idx = idx_BTK[:, t0:t1]
        kv = _gather(latent_PL, idx, q_BTHA.device, dtype)
        kr = _gather(rope_PR, idx, q_BTHA.device, dtype)
        q = q_BTHA[:, t0:t1].to(dtype)
        do = dout_BTHL[:, t0:t1].to(dtype)
        s = _scores(q, kv, kr, idx >= 0, scale)
        p = torch.exp(s - _safe(lse_BTH[:, t0:t1])[..., None])
        ds = p * (torch.einsum("bchl,bckl->bchk", do, kv) - delta_BTH[:, t0:t1, :, None]) * scale
        if need_q:
            dq_BTHA[:, t0:t1, :, :L] = torch.einsum("bchk,bckl->bchl", ds, kv)
            dq_BTHA[:, t0:t1, :, L:] = torch.einsum("bchk,bckr->bchr", ds, kr)
        flat = idx.clamp(min=0).reshape(-1)
        if need_lat:
            # a gathered entry is both key (via ds) and value (via p); -1 entries have p = ds = 0
            d_kv = torch.einsum("bchk,bchl->bckl", ds, q[..., :L]) + torch.einsum("bchk,bchl->bckl", p, do)
            dlat_PL.index_add_(0, flat.to(dlat_PL.device), d_kv.reshape(-1, L))
        if need_rope:
            d_kr = torch.einsum("bchk,bchr->bckr", ds, q[..., L:])
            drope_PR.index_add_(0, flat.to(drope_PR.device), d_kr.reshape(-1, A - L))
    return (
        dq_BTHA.to(q_BTHA.dtype) if need_q else None,
        dlat_PL.to(device=latent_PL.device, dtype=latent_PL.dtype) if need_lat else None,
        drope_PR.to(device=rope_PR.device, dtype=rope_PR.dtype) if need_rope else None,
    )


def check_shapes(q_BTHA, latent_PL, rope_PR, idx_BTK) -> None:
    """ValueError naming the shapes when q, the pages and idx do not fit together."""
    if q_BTHA.dim() != 4 or idx_BTK.dim() != 3 or idx_BTK.shape[:2] != q_BTHA.shape[:2]:
        raise ValueError(f"expected q [B, T, H, A] and idx [B, T, K]; got {tuple(q_BTHA.shape)}, "
                         f"{tuple(idx_BTK.shape)}")
    if latent_PL.shape[-1] + rope_PR.shape[-1] != q_BTHA.shape[-1] or latent_PL.shape[0] != rope_PR.shape[0]:
        raise ValueError(
            f"q's last dim {q_BTHA.shape[-1]} must be latent {tuple(latent_PL.shape)} + rope "
            f"{tuple(rope_PR.shape)} dims"
        )


def sparse_mla_attention(q_BTHA, latent_PL, rope_PR, idx_BTK, *, scale):
    """-> (out_BTHL in q's dtype, lse_BTH in the compute dtype).

    Row (b, t, h) attends to the pages idx[b, t, :] (entries -1 are skipped; a row with none gets out 0 and
    lse -inf). Keys are [latent | rope], values latent; q is the absorbed query [q_nope W_uk | q_rope].
    Differentiable in q and in the pages (scatter-added over the selected entries); lse is differentiable too,
    so partial results merge by LSE outside (response keys, context-parallel shards)."""
    check_shapes(q_BTHA, latent_PL, rope_PR, idx_BTK)
    return _SparseMLA.apply(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)


def dense_mla_attention(q_BTHA, latent_BSL, rope_BSR, allowed_BTS, *, scale):
    """Absorbed MLA over a few per-sequence keys with an explicit mask, plain autograd. -> (out_BTHL, lse_BTH);
    rows with no allowed key get out 0 and lse -inf (and zero gradient)."""
    dtype = compute_dtype(q_BTHA, latent_BSL, rope_BSR)
    L = latent_BSL.shape[-1]
    q = q_BTHA.to(dtype)
    kv, kr = latent_BSL.to(dtype), rope_BSR.to(dtype)
    s = torch.einsum("bthl,bsl->bths", q[..., :L], kv) + torch.einsum("bthr,bsr->bths", q[..., L:], kr)
    s = (s * scale).masked_fill(~allowed_BTS[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # masked_fill zeroes the gradient of every masked score, which covers the NaN of an all-masked row's lse
    p = torch.exp(s - _safe(lse)[..., None])
    return torch.einsum("bths,bsl->bthl", p, kv).to(q_BTHA.dtype), lse


def merge_lse(out_a, lse_a, out_b, lse_b):
    """Exact combination of two partial softmax results over disjoint key sets (at most one lse -inf per row)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse)[..., None]
    wb = torch.exp(lse_b - lse)[..., None]
    out = wa * out_a.to(lse.dtype) + wb * out_b.to(lse.dtype)
    return out.to(out_a.dtype), lse


def own_slots(idx_BTK, num_pages: int, slots: int) -> torch.Tensor:
    """Entries of the second key source (`sparse_mla_two_sources`) as rows of its [B * slots] keys: entry
    num_pages + s of sequence b is row b * slots + s; every other entry -1."""
    B = idx_BTK.shape[0]
    slot_BTK = idx_BTK - num_pages
    row_B11 = torch.arange(B, device=idx_BTK.device)[:, None, None] * slots
    return torch.where((slot_BTK >= 0) & (slot_BTK < slots), slot_BTK + row_B11, -1)


def sparse_mla_two_sources(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR, idx_BTK, slots: int, *, scale,
                           attention_fn=sparse_mla_attention):
    """Absorbed MLA over the selected entries of two key sources at once (the decode: the prompt's P pages and each
    response's own `slots` keys): an entry in [0, P) is page row idx, one in [P, P + slots) the key idx - P of its
    sequence b, row b * slots + (idx - P) of new_* [B * slots, L] / [B * slots, R]; others none. Here each source
    through `attention_fn` (`sparse_mla_attention`'s signature), merged by their lse. -> (out_BTHL, lse_BTH); every
    row needs an entry among the pages (`merge_lse`)."""
    P = latent_PL.shape[0]
    out_BTHL, lse_BTH = attention_fn(q_BTHA, latent_PL, rope_PR, idx_BTK.masked_fill(idx_BTK >= P, -1), scale=scale)
    out_new, lse_new = attention_fn(q_BTHA, new_latent_NL, new_rope_NR, own_slots(idx_BTK, P, slots), scale=scale)
    return merge_lse(out_BTHL, lse_BTH, out_new, lse_new)


def naive_sparse_mla_attention(q_BTHA, latent_PL, rope_PR, idx_BTK, *, scale):
    """Test oracle: gather every selected page at once, mask, softmax; plain autograd. -> (out, lse)."""
    dtype = compute_dtype(q_BTHA, latent_PL, rope_PR)
    kv = _gather(latent_PL, idx_BTK, q_BTHA.device, dtype)
    kr = _gather(rope_PR, idx_BTK, q_BTHA.device, dtype)
    s = _scores(q_BTHA.to(dtype), kv, kr, idx_BTK >= 0, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bthk,btkl->bthl", p, kv).to(q_BTHA.dtype), lse
