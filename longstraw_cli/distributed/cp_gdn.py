"""Context parallelism for Gated DeltaNet capture: each rank scans its own contiguous span of the prompt.

Per value head the recurrence is linear in the state S [K, V], so a span of tokens maps the state it starts from
to

    S_out = M @ S_in + S_ext        (M [K, K] acts on the key side; S_ext = the span's state from S_in = 0)

Every rank computes (M, S_ext) of its own span with one local scan, the ranks all_gather them (one collective
of a few KiB per head), and every rank composes the prefix of the spans before it to get its S_in, then scans
its span again from S_in for the real outputs (LASP-2; fla's CP for GDN does the same on GPU). No rank waits
for another's scan, and the composed final state is the state after the WHOLE sequence, identical on every
rank. The short causal conv in front of the scan needs only the W inputs before the span, which
`cp_conv_window` gathers the same way.

Exact mode (`capture.gradient=exact`) needs the carried state at every capture block's start. Given a
`SpanBoundaries`, `cp_gdn_scan` runs its second (output) scan in pieces cut at the block starts inside the span
and keeps the state before each piece, and `cp_conv_window` keeps the W conv inputs before each: no extra scan,
only more, shorter kernel calls. Each rank keeps the boundaries of its own span (cp_walk.py).

Simplifications: capture only (no autograd through the exchange; `cp_gdn_scan` refuses inputs that require
grad); the spans are contiguous in rank order (no zigzag); every rank must make the same calls in the same
order with the same B, G, K, V (T may differ, 0 included).

Legend: N spans (= ranks of the CP group, rank 0 first), B batch, T this rank's tokens, H key heads,
G value heads (a multiple of H), K key dim, V value dim, X conv channels, W conv window (kernel - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from longstraw_cli.distributed.comm import rank_world
from longstraw_kernels import compute_dtype, needs_grad
from longstraw_kernels.gdn import gdn_chunked

__all__ = ["SpanBoundaries", "compose_prefix", "cp_conv_window", "cp_gdn_scan", "gdn_transition", "span_affine"]


@dataclass
class SpanBoundaries:
    """One GDN layer's carried state at given offsets of this rank's span (exact mode's capture: the capture
    blocks that start in the span), batch row 0: per offset the W conv inputs before it (`cp_conv_window`) and
    the recurrent state before it (`cp_gdn_scan`). Offsets ascending, in [0, T)."""

    offsets: list[int]
    conv_XW: list[torch.Tensor] = field(default_factory=list)
    ssm_GKV: list[torch.Tensor] = field(default_factory=list)


def _all_gather(x, group, world: int) -> list[torch.Tensor]:
    if world == 1:
        return [x]
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def span_affine(k_BTHK, v_BTGV, g_BTG, beta_BTG, *, dtype=None, chunk_size=64, gdn_fn=gdn_chunked):
    """(M_BGKK, S_ext_BGKV) of a span, from ONE scan of width V + K: the span maps S_in to M @ S_in + S_ext.

    Linearity in (v, S_in) jointly: scanning v_aug = [v | 0_K] from [0_V | I_K] ends in [S_ext | M]. q is zeros,
    so the scan's outputs are discarded. T = 0 gives (I, 0) without calling `gdn_fn`. `dtype` defaults to the
    kernel's compute dtype of the inputs (the states come back in it).
    """
    if k_BTHK.dim() != 4 or v_BTGV.dim() != 4 or g_BTG.dim() != 3:
        raise ValueError(f"need k [B, T, H, K], v [B, T, G, V], g [B, T, G]; got {tuple(k_BTHK.shape)}, "
                         f"{tuple(v_BTGV.shape)}, {tuple(g_BTG.shape)}")
    B, T, _, K = k_BTHK.shape
    G, V = v_BTGV.shape[2:]
    dtype = dtype or compute_dtype(k_BTHK, v_BTGV, g_BTG, beta_BTG)
    eye_BGKK = torch.eye(K, dtype=dtype, device=k_BTHK.device).expand(B, G, K, K)
    if T == 0:
        return eye_BGKK.clone(), torch.zeros(B, G, K, V, dtype=dtype, device=k_BTHK.device)
    v_aug_BTGW = torch.cat([v_BTGV, v_BTGV.new_zeros(B, T, G, K)], dim=-1)
    init_BGKW = torch.cat([torch.zeros(B, G, K, V, dtype=dtype, device=k_BTHK.device), eye_BGKK], dim=-1)
    _, final_BGKW = gdn_fn(k_BTHK.new_zeros(k_BTHK.shape), k_BTHK, v_aug_BTGW, g_BTG, beta_BTG, init_BGKW,
                           chunk_size=chunk_size)
    return final_BGKW[..., V:], final_BGKW[..., :V]


def gdn_transition(k_BTHK, g_BTG, beta_BTG, *, chunk_size=64, gdn_fn=gdn_chunked):
    """M_BGKK of a span: its final state is M @ S_in + S_ext for S as [K, V], i.e. M = A_T ... A_1 with
    A_t = exp(g_t) (I - beta_t k_t k_t^T) (later tokens on the left). Computed as the final state of a scan with
    v = 0 of width K from S_in = I. The compute dtype is the kernel's (fp32 for fp32/bf16, fp64 for fp64)."""
    B, T = k_BTHK.shape[:2]
    no_values_BTG0 = k_BTHK.new_zeros(B, T, g_BTG.shape[-1], 0)
    return span_affine(k_BTHK, no_values_BTG0, g_BTG, beta_BTG, chunk_size=chunk_size, gdn_fn=gdn_fn)[0]


def compose_prefix(M_NBGKK, Sext_NBGKV, initial_BGKV=None):
    """-> (S_in_NBGKV, final_BGKV): S_in of span i is the state after spans 0..i-1 (span 0 starts from
    `initial_BGKV`, zeros if None); final is the state after all N spans. Computed in Sext's dtype."""
    if (M_NBGKK.dim() != 5 or Sext_NBGKV.dim() != 5 or M_NBGKK.shape[:3] != Sext_NBGKV.shape[:3]
            or M_NBGKK.shape[-1] != M_NBGKK.shape[-2] or M_NBGKK.shape[-1] != Sext_NBGKV.shape[-2]):
        raise ValueError(f"need M [N, B, G, K, K] and S_ext [N, B, G, K, V], got {tuple(M_NBGKK.shape)} "
                         f"and {tuple(Sext_NBGKV.shape)}")
    if initial_BGKV is not None and initial_BGKV.shape != Sext_NBGKV.shape[1:]:
        raise ValueError(f"initial state must be {tuple(Sext_NBGKV.shape[1:])}, got {tuple(initial_BGKV.shape)}")
    dtype = Sext_NBGKV.dtype
    state_BGKV = Sext_NBGKV.new_zeros(Sext_NBGKV.shape[1:]) if initial_BGKV is None else initial_BGKV.to(dtype)
    s_in_list_BGKV = []
    for M_BGKK, Sext_BGKV in zip(M_NBGKK.to(dtype), Sext_NBGKV):
        s_in_list_BGKV.append(state_BGKV)
        state_BGKV = M_BGKK @ state_BGKV + Sext_BGKV
    if not s_in_list_BGKV:
        return Sext_NBGKV.new_zeros(Sext_NBGKV.shape), state_BGKV
    return torch.stack(s_in_list_BGKV), state_BGKV


def cp_gdn_scan(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, *, group=None, scale=None,
                chunk_size=64, gdn_fn=gdn_chunked, boundaries: SpanBoundaries | None = None):
    """Gated delta rule over a sequence split across the ranks of `group` (rank r holds the r-th contiguous span;
    spans may be uneven or empty). -> (o_local_BTGV in v's dtype, final_state_BGKV after the WHOLE sequence,
    identical on every rank, in the compute dtype).

    `initial_state_BGKV` is the state before rank 0's span and must be the same on every rank. Positional
    arguments match `gdn_fn`, so `functools.partial(cp_gdn_scan, group=g)` can stand in for it. Collective:
    every rank of the group must call it, with the same B, G, K, V and dtypes. `boundaries`: the states at its
    offsets are kept there (the local scan then runs in pieces cut at them).
    """
    inputs = (q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV)
    if needs_grad(*inputs):
        raise ValueError("cp_gdn_scan is capture-only (no autograd through the exchange): call it under "
                         "torch.no_grad() or with inputs that do not require grad")
    rank, world = rank_world(group)
    dtype = compute_dtype(*inputs)
    M_BGKK, Sext_BGKV = span_affine(k_BTHK, v_BTGV, g_BTG, beta_BTG, dtype=dtype, chunk_size=chunk_size,
                                    gdn_fn=gdn_fn)
    V = Sext_BGKV.shape[-1]
    # One collective: every span's [S_ext | M] side by side.
    packed_list_BGKW = _all_gather(torch.cat([Sext_BGKV, M_BGKK], dim=-1), group, world)
    packed_NBGKW = torch.stack(packed_list_BGKW)
    S_in_NBGKV, final_BGKV = compose_prefix(packed_NBGKW[..., V:], packed_NBGKW[..., :V], initial_state_BGKV)
    if v_BTGV.shape[1] == 0:
        return v_BTGV.new_zeros(v_BTGV.shape), final_BGKV
    if boundaries is None or not boundaries.offsets:
        o_BTGV, _ = gdn_fn(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, S_in_NBGKV[rank], scale=scale,
                           chunk_size=chunk_size)
        return o_BTGV, final_BGKV
    # the pieces' outputs go into one buffer: no second copy of the span's output
    o_BTGV, state_BGKV = torch.empty_like(v_BTGV), S_in_NBGKV[rank]
    edges = [0, *(t for t in boundaries.offsets if t > 0), v_BTGV.shape[1]]
    for t0, t1 in zip(edges, edges[1:]):
        if t0 in boundaries.offsets:
            boundaries.ssm_GKV.append(state_BGKV[0].clone())
        o_BTGV[:, t0:t1], state_BGKV = gdn_fn(q_BTHK[:, t0:t1], k_BTHK[:, t0:t1], v_BTGV[:, t0:t1],
                                              g_BTG[:, t0:t1], beta_BTG[:, t0:t1], state_BGKV, scale=scale,
                                              chunk_size=chunk_size)
    return o_BTGV, final_BGKV


def cp_conv_window(mixed_BTX, window_BXW, *, group=None, boundaries: SpanBoundaries | None = None):
    """Conv windows of a sequence split across the ranks of `group`: -> (window_in_BXW, window_out_BXW).

    `mixed_BTX`: this rank's pre-conv inputs; `window_BXW`: the W inputs before rank 0's span (zeros for a fresh
    prompt; same on every rank; broadcast over B allowed). window_in = the W inputs before this rank's span,
    i.e. the last W of [window, span_0, ..., span_{r-1}]; window_out = the last W after the whole sequence (the
    conv state to keep), identical on every rank. Spans shorter than W (or empty) are handled: every rank
    contributes its last min(W, T) inputs, right-aligned in W slots, with a validity row. One collective;
    results in mixed_BTX's dtype. `boundaries`: the window before each of its offsets is kept there.
    """
    if mixed_BTX.dim() != 3 or window_BXW.dim() != 3 or window_BXW.shape[1] != mixed_BTX.shape[2]:
        raise ValueError(f"need mixed [B, T, X] and window [B, X, W] with the same X, got "
                         f"{tuple(mixed_BTX.shape)} and {tuple(window_BXW.shape)}")
    B, T, X = mixed_BTX.shape
    W = window_BXW.shape[-1]
    window_BXW = window_BXW.to(mixed_BTX.dtype).expand(B, X, W)
    rank, world = rank_world(group)
    if W == 0:
        window_in_BXW, window_out_BXW = window_BXW.clone(), window_BXW.clone()
    else:
        window_in_BXW, window_out_BXW = _gather_windows(mixed_BTX, window_BXW, group, rank, world)
    if boundaries is not None:
        # the last W of [window_in | the span's inputs before t], batch row 0
        boundaries.conv_XW += [torch.cat([window_in_BXW[0, :, t:], mixed_BTX[0, max(0, t - W) : t].T], dim=-1)
                               for t in boundaries.offsets]
    return window_in_BXW, window_out_BXW


def _gather_windows(mixed_BTX, window_BXW, group, rank: int, world: int):
    """`cp_conv_window`'s exchange, W > 0."""
    B, T, X = mixed_BTX.shape
    W = window_BXW.shape[-1]
    num_tail = min(W, T)
    # Channel X of the tail marks the valid slots, so lengths travel in the same collective.
    tail_BYW = mixed_BTX.new_zeros(B, X + 1, W)
    tail_BYW[:, :X, W - num_tail:] = mixed_BTX[:, T - num_tail:].transpose(1, 2)
    tail_BYW[:, X, W - num_tail:] = 1
    tails_list_BYW = _all_gather(tail_BYW, group, world)
    # one host sync for all lengths (tiny); the valid mark is the same for every batch row
    lengths = torch.stack([t[0, X] for t in tails_list_BYW]).sum(-1).round().long().tolist()
    current_BXW, window_in_BXW = window_BXW, None
    for i, (t_BYW, n) in enumerate(zip(tails_list_BYW, lengths)):
        if i == rank:
            window_in_BXW = current_BXW
        current_BXW = torch.cat([current_BXW, t_BYW[:, :X, W - n:]], dim=-1)[..., -W:]
    return window_in_BXW.clone(), current_BXW.clone()
