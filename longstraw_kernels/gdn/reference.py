"""Torch reference for the gated delta rule (GDN), the linear-attention mixer of Qwen3.5/3.6.

Two implementations of one recurrence, per value head with a state S [K, V]:

    S <- S * exp(g_t);  delta_t = beta_t (v_t - S^T k_t);  S <- S + k_t delta_t^T;  o_t = S^T (scale q_t)

`gdn_recurrent` runs it token by token; `gdn_chunked` solves each chunk at once with the WY/UT transform
(`chunk_terms`, batched over chunks) and scans sequentially over chunks in a Python loop (derivation in README.md
beside this file). Both match Hugging Face's `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule`
with use_qk_l2norm_in_kernel=False. `triton_chunk.py` runs the same `chunk_terms` and replaces the loop with
Triton kernels.

Simplifications against the fused kernels: q and k must come in L2-normalised (no in-kernel norm), no
variable-length packing (cu_seqlens), and the chunked form keeps every chunk's [C, C] matrices in memory.
Everything is out-of-place, so plain autograd gives the backward.

Shape legend:
    B batch, T time, H key heads, G value heads (a multiple of H; value head j reads key head j // (G // H)),
    K key dim, V value dim, N number of chunks, C chunk size.
"""

from typing import NamedTuple

import torch

from longstraw_kernels import at_least_fp32, compute_dtype


def prepare_inputs(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale):
    """Validate shapes, cast to the compute dtype, expand key heads to value heads, move time to dim 2."""
    if q_BTHK.dim() != 4 or q_BTHK.shape != k_BTHK.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q_BTHK.shape)} and {tuple(k_BTHK.shape)}")
    B, T, H, K = k_BTHK.shape
    if v_BTGV.dim() != 4 or v_BTGV.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, G, V], got {tuple(v_BTGV.shape)}")
    G, V = v_BTGV.shape[2:]
    if G % H != 0:
        raise ValueError(f"value heads G={G} must be a multiple of key heads H={H}")
    for name, t in (("g", g_BTG), ("beta", beta_BTG)):
        if t.shape != (B, T, G):
            raise ValueError(f"{name} must be [B={B}, T={T}, G={G}], got {tuple(t.shape)}")
    if initial_state_BGKV is not None and initial_state_BGKV.shape != (B, G, K, V):
        raise ValueError(f"initial_state must be [B={B}, G={G}, K={K}, V={V}], got {tuple(initial_state_BGKV.shape)}")

    dtype = compute_dtype(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV)
    scale = K**-0.5 if scale is None else scale
    q_BGTK = (q_BTHK.to(dtype) * scale).repeat_interleave(G // H, dim=2).transpose(1, 2)
    k_BGTK = k_BTHK.to(dtype).repeat_interleave(G // H, dim=2).transpose(1, 2)
    v_BGTV = v_BTGV.to(dtype).transpose(1, 2)
    g_BGT = g_BTG.to(dtype).transpose(1, 2)
    beta_BGT = beta_BTG.to(dtype).transpose(1, 2)
    if initial_state_BGKV is None:
        state_BGKV = torch.zeros(B, G, K, V, dtype=dtype, device=v_BTGV.device)
    else:
        state_BGKV = initial_state_BGKV.to(dtype)
    return q_BGTK, k_BGTK, v_BGTV, g_BGT, beta_BGT, state_BGKV


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dim, as HF's Qwen3-Next normalises q and k (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_decay(a_BTG: torch.Tensor, a_log_G: torch.Tensor, dt_bias_G: torch.Tensor) -> torch.Tensor:
    """The log-decay g = -exp(A_log) softplus(a + dt_bias), in fp32 at least (HF computes it in fp32)."""
    return -at_least_fp32(a_log_G).exp() * torch.nn.functional.softplus(at_least_fp32(a_BTG) + dt_bias_G)


def causal_conv_silu(full_BXS: torch.Tensor, weight_X1K: torch.Tensor) -> torch.Tensor:
    """GDN's short causal depthwise conv over full_BXS (the W = K - 1 tokens before, then the new ones; no padding)
    and its SiLU -> [B, X, S - W]."""
    return torch.nn.functional.silu(torch.nn.functional.conv1d(full_BXS, weight_X1K, groups=full_BXS.shape[1]))


def conv_window_after(window_BXW: torch.Tensor, mixed_BTX: torch.Tensor) -> torch.Tensor:
    """The conv's window after mixed: the last W of (window_BXW, then mixed_BTX's tokens) -> [B, X, W], a tensor of
    its own (exactly W columns)."""
    W, T = window_BXW.shape[-1], mixed_BTX.shape[1]
    return torch.cat([window_BXW[..., min(T, W) :], mixed_BTX[:, max(0, T - W) :].transpose(1, 2)], dim=-1)


def conv_step_reference(mixed_BTX, window_BXW, weight_X1K):
    """A few tokens of `causal_conv_silu` from the window state window_BXW, which then holds the last W inputs
    (in place). -> [B, T, X] in mixed's dtype."""
    full_BXS = torch.cat([window_BXW.to(mixed_BTX.dtype), mixed_BTX.transpose(1, 2)], dim=-1)
    window_BXW.copy_(full_BXS[..., full_BXS.shape[-1] - window_BXW.shape[-1] :])
    return causal_conv_silu(full_BXS, weight_X1K).transpose(1, 2)


def gdn_decode_reference(q_BTHK, k_BTHK, v_BTGV, a_BTG, b_BTG, a_log_G, dt_bias_G, state_BGKV, scale=None):
    """A few tokens per sequence from raw inputs, without gradient (the decode step: T = 1): q and k before their
    L2 norm, a and b before the gates (g = `gdn_decay`, beta = sigmoid(b), both in the compute dtype), then
    `gdn_recurrent` from state_BGKV, which is advanced in place. -> o_BTGV in v's dtype."""
    q_BTHK, k_BTHK = l2norm(at_least_fp32(q_BTHK)), l2norm(at_least_fp32(k_BTHK))
    beta_BTG = at_least_fp32(b_BTG).sigmoid()
    o_BTGV, final_BGKV = gdn_recurrent(q_BTHK, k_BTHK, v_BTGV, gdn_decay(a_BTG, a_log_G, dt_bias_G), beta_BTG,
                                       state_BGKV, scale)
    state_BGKV.copy_(final_BGKV)
    return o_BTGV


def gdn_recurrent(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, scale=None):
    """Token-by-token gated delta rule; returns (o_BTGV in v's dtype, final_state_BGKV in the compute dtype)."""
    q_BGTK, k_BGTK, v_BGTV, g_BGT, beta_BGT, state_BGKV = prepare_inputs(
        q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale
    )
    o_list_BGV = []
    for t in range(v_BGTV.shape[2]):
        k_BGK = k_BGTK[:, :, t]
        state_BGKV = state_BGKV * g_BGT[:, :, t].exp()[..., None, None]
        predicted_BGV = torch.einsum("bgk,bgkv->bgv", k_BGK, state_BGKV)
        delta_BGV = beta_BGT[:, :, t, None] * (v_BGTV[:, :, t] - predicted_BGV)
        state_BGKV = state_BGKV + k_BGK[..., :, None] * delta_BGV[..., None, :]
        o_list_BGV.append(torch.einsum("bgk,bgkv->bgv", q_BGTK[:, :, t], state_BGKV))
    if not o_list_BGV:
        return v_BTGV.new_zeros(v_BTGV.shape), state_BGKV
    o_BTGV = torch.stack(o_list_BGV, dim=1)
    return o_BTGV.to(v_BTGV.dtype), state_BGKV


def gdn_chunked(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, scale=None, chunk_size=64):
    """Same result as `gdn_recurrent`: WY/UT transform within chunks of `chunk_size`, sequential over chunks."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    q_BGTK, k_BGTK, v_BGTV, g_BGT, beta_BGT, state_BGKV = prepare_inputs(
        q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale
    )
    if k_BGTK.shape[2] == 0:
        return v_BTGV.new_zeros(v_BTGV.shape), state_BGKV

    terms = chunk_terms(q_BGTK, k_BGTK, v_BGTV, g_BGT, beta_BGT, chunk_size)
    o_list_BGCV = []
    for n in range(terms.chunk_decay_BGN.shape[-1]):
        u_BGCV = terms.w_v_BGNCV[:, :, n] - terms.w_k_BGNCK[:, :, n] @ state_BGKV
        o_list_BGCV.append(terms.q_decayed_BGNCK[:, :, n] @ state_BGKV + terms.attn_BGNCC[:, :, n] @ u_BGCV)
        write_BGKV = terms.k_to_end_BGNCK[:, :, n].transpose(-1, -2) @ u_BGCV
        state_BGKV = state_BGKV * terms.chunk_decay_BGN[:, :, n, None, None] + write_BGKV
    o_BGTV = torch.cat(o_list_BGCV, dim=2)[:, :, : k_BGTK.shape[2]]
    return o_BGTV.transpose(1, 2).contiguous().to(v_BTGV.dtype), state_BGKV


class ChunkTerms(NamedTuple):
    """What each chunk contributes from its own tokens (README.md's names), for all N chunks at once. With S0 a
    chunk's start state: U = w_v - w_k S0, O = q_decayed S0 + attn U, S_C = chunk_decay S0 + k_to_end^T U."""

    w_v_BGNCV: torch.Tensor  # (I + A)^-1 (beta V)
    w_k_BGNCK: torch.Tensor  # (I + A)^-1 (beta exp(b) K)
    attn_BGNCC: torch.Tensor  # (Q K^T) * D, diagonal included: o_i sees its own write u_i
    q_decayed_BGNCK: torch.Tensor  # exp(b) Q
    k_to_end_BGNCK: torch.Tensor  # exp(b_C - b) K
    chunk_decay_BGN: torch.Tensor  # exp(b_C)


def chunk_terms(q_BGTK, k_BGTK, v_BGTV, g_BGT, beta_BGT, chunk_size: int) -> ChunkTerms:
    """The per-chunk terms of prepared inputs (`prepare_inputs`), T padded to N = ceil(T / chunk_size) chunks.
    Batched over chunks: everything the sequential scan over chunks does not need to wait for."""
    B, G, T, _ = k_BGTK.shape
    # Padded tokens have g = 0 (no decay) and beta = k = 0 (no write), so they leave the state untouched.
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    q_BGNCK, k_BGNCK, v_BGNCV = (
        torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(B, G, N, C, x.shape[-1]) for x in (q_BGTK, k_BGTK, v_BGTV)
    )
    g_BGNC, beta_BGNC = (torch.nn.functional.pad(x, (0, pad)).reshape(B, G, N, C) for x in (g_BGT, beta_BGT))

    # b_i = log of the decay from the chunk start through token i (inclusive).
    b_BGNC = g_BGNC.cumsum(dim=-1)
    # decay_ij = exp(b_i - b_j) for j <= i; the upper triangle is masked before exp so it cannot overflow.
    upper_CC = torch.ones(C, C, dtype=torch.bool, device=b_BGNC.device).triu(1)
    decay_BGNCC = (b_BGNC[..., :, None] - b_BGNC[..., None, :]).masked_fill(upper_CC, float("-inf")).exp()

    # (I + A) U = beta V - beta exp(b) K S0 with A_ij = beta_i decay_ij k_i.k_j strictly below the diagonal;
    # the solve is unitriangular, so A's diagonal is ignored.
    kbeta_BGNCK = k_BGNCK * beta_BGNC[..., None]
    a_BGNCC = (kbeta_BGNCK @ k_BGNCK.transpose(-1, -2)) * decay_BGNCC
    w_v_BGNCV = torch.linalg.solve_triangular(a_BGNCC, v_BGNCV * beta_BGNC[..., None], upper=False, unitriangular=True)
    w_k_BGNCK = torch.linalg.solve_triangular(
        a_BGNCC, kbeta_BGNCK * b_BGNC.exp()[..., None], upper=False, unitriangular=True
    )
    return ChunkTerms(
        w_v_BGNCV=w_v_BGNCV,
        w_k_BGNCK=w_k_BGNCK,
        attn_BGNCC=(q_BGNCK @ k_BGNCK.transpose(-1, -2)) * decay_BGNCC,
        q_decayed_BGNCK=q_BGNCK * b_BGNC.exp()[..., None],
        k_to_end_BGNCK=k_BGNCK * (b_BGNC[..., -1:] - b_BGNC).exp()[..., None],
        chunk_decay_BGN=b_BGNC[..., -1].exp(),
    )
