"""One decode token of a GDN layer in two Triton launches, for CUDA: `conv_step_reference`'s and
`gdn_decode_reference`'s contracts. (Both in one launch, the conv's window a ring of slots, measured no faster on an
H200: qwen36_mini's step 2.816 against 2.810 ms, docs/BENCHMARKS.md 2026-12-05; git keeps it, commit de77ffc.)

The decode step's GDN layer ran its conv (a cat, cuDNN's depthwise conv, a SiLU), q and k's L2 norms, the decay g
and the write strength beta in small torch kernels (fused by torch.compile, but cut off from fla's recurrent
kernel, which dynamo does not trace), cast q, k and beta for fla's kernel, ran it (the state read once and written
to a new tensor) and copied the new state back into the response's state: on an H200 at qwen36_mini's shape
(G = 32 heads of [128, 128] fp32 per response, B = 8) each copy moves another 33 MB, as many bytes as the
recurrent step itself. Here:

`conv_step_triton`: the K-tap depthwise conv over the window's W = K - 1 inputs and the new one, in fp32, its SiLU,
and the window moved on in place (a program owns BX channels of one response: it reads their window, then writes
it).

`gdn_decode_triton`: from the conv's outputs and the raw gate inputs, the state advanced in place:

    q <- q / |q| * scale,  k <- k / |k|,  g = -exp(A_log) softplus(a + dt_bias),  beta = sigmoid(b)
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q

A program owns one (response, value head) pair and BV of its value columns, with its [K, BV] slice of the state in
registers: it reads that slice before it writes it, and no other program touches it, so the state is updated in
place. Everything is computed in fp32 (the references' `compute_dtype`); outputs are stored in the inputs' dtype.

Exactness: tests/kernels/test_gdn_step.py (Triton's interpreter on CPU, fp32 and bf16 inputs) and
tests/models/test_gpu_decode.py (CUDA, qwen36_mini's shapes, against fp64) and the decode tests there.

Shape legend: B responses, H key heads, G value heads (a multiple of H), K key dim, V value dim, BV value columns
per program; for the conv X channels, W window, K taps, BX channels per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv_step_triton", "conv_supported", "gdn_decode_triton", "supported"]

# fla's choice for its recurrent kernel (one warp, 8 value columns): at qwen36_mini's shape it moved the state at
# ~4.6 TB/s on an H200 (0.13 ms for 18 layers' 33 MB each)
BLOCK_V = 8
NUM_WARPS = 1
MAX_KEY_DIM = 256  # the [K, BV] fp32 state slice stays in one warp's registers


@triton.jit
def _program(GROUP: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
             BV: tl.constexpr):
    """What a program of the step owns: (its block of value columns, row = response b and value head g, b, g, key
    head h, key offsets, value columns, their masks)."""
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    b, g = row // G, row % G
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    return pid_v, row, b, g, g // GROUP, offs_k, offs_v, offs_k < K, offs_v < V


@triton.jit
def _recurrence(q, k, v, b, g, row, offs_k, offs_v, mask_k, mask_v, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr,
                o_ptr, stride_ab, stride_ag, stride_bb, stride_bg, stride_ob, stride_og, scale, eps,
                K: tl.constexpr, V: tl.constexpr):
    """One program's share of the step from raw q, k [BK] and its v columns [BV] (fp32): the norms, the gates, its
    [K, BV] slice of the state (response b, value head g = row's) advanced in place, its columns of o stored."""
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + eps)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + eps))

    # torch's softplus: x above its threshold of 20, else log(1 + exp(x))
    x = tl.load(a_ptr + b * stride_ab + g * stride_ag).to(tl.float32) + tl.load(dt_bias_ptr + g).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + g).to(tl.float32)) * softplus)
    beta = tl.sigmoid(tl.load(b_ptr + b * stride_bb + g * stride_bg).to(tl.float32))

    kv = row * K * V + offs_k[:, None] * V + offs_v[None, :]
    mask_kv = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptr + kv, mask=mask_kv, other=0.0) * decay
    u = beta * (v - tl.sum(state * k[:, None], 0))
    state = state + k[:, None] * u[None, :]
    o = tl.sum(state * q[:, None], 0)
    tl.store(state_ptr + kv, state, mask=mask_kv)
    tl.store(o_ptr + b * stride_ob + g * stride_og + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _decode_step_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, o_ptr,
                        stride_qb, stride_qh, stride_qk, stride_kb, stride_kh, stride_kk,
                        stride_vb, stride_vg, stride_vv, stride_ab, stride_ag, stride_bb, stride_bg,
                        stride_ob, stride_og, scale, eps, GROUP: tl.constexpr, G: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    pid_v, row, b, g, h, offs_k, offs_v, mask_k, mask_v = _program(GROUP, G, K, V, BK, BV)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_k * stride_qk, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + offs_k * stride_kk, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vb + g * stride_vg + offs_v * stride_vv, mask=mask_v, other=0.0).to(tl.float32)
    _recurrence(q, k, v, b, g, row, offs_k, offs_v, mask_k, mask_v, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr,
                o_ptr, stride_ab, stride_ag, stride_bb, stride_bg, stride_ob, stride_og, scale, eps, K, V)


@triton.jit
def _conv_step_kernel(mixed_ptr, window_ptr, weight_ptr, out_ptr, X, stride_mb, stride_mx, stride_wx,
                      W: tl.constexpr, WP: tl.constexpr, BX: tl.constexpr):
    # one program: response b, channels [pid_x BX, (pid_x + 1) BX); it reads their window before it writes it
    pid_x = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_x = pid_x * BX + tl.arange(0, BX)
    offs_w = tl.arange(0, WP)
    mask_x = offs_x < X
    mask_xw = mask_x[:, None] & (offs_w[None, :] < W)
    xw = (b * X + offs_x[:, None]) * W + offs_w[None, :]
    window = tl.load(window_ptr + xw, mask=mask_xw, other=0.0)
    new = tl.load(mixed_ptr + b * stride_mb + offs_x * stride_mx, mask=mask_x, other=0.0)
    taps = tl.load(weight_ptr + offs_x[:, None] * stride_wx + offs_w[None, :], mask=mask_xw, other=0.0)
    last_tap = tl.load(weight_ptr + offs_x * stride_wx + W, mask=mask_x, other=0.0)
    acc = tl.sum(window.to(tl.float32) * taps.to(tl.float32), 1) + new.to(tl.float32) * last_tap.to(tl.float32)
    tl.store(out_ptr + b * X + offs_x, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=mask_x)
    # the window moves one place: tap j takes tap j + 1 (the register tile, shifted by a 0/1 matrix), the last
    # takes the new input
    shift = (offs_w[:, None] == offs_w[None, :] + 1).to(tl.float32)  # [WP, WP]: column j picks row j + 1
    moved = tl.sum(window.to(tl.float32)[:, :, None] * shift[None, :, :], 1)
    moved = tl.where(offs_w[None, :] == W - 1, new.to(tl.float32)[:, None], moved)
    tl.store(window_ptr + xw, moved.to(window_ptr.dtype.element_ty), mask=mask_xw)


def conv_step_triton(mixed_BTX, window_BXW, weight_X1K):
    """One token of the causal depthwise conv and its SiLU (the conv's K = W + 1 taps over the W-token window and
    the new input), the window moved on in place. mixed_BTX [B, 1, X] any strides, window_BXW contiguous, weight
    [X, 1, K]. -> silu(conv) [B, 1, X] in mixed's dtype, accumulated in fp32."""
    B, T, X = mixed_BTX.shape
    W = window_BXW.shape[-1]
    if (T != 1 or window_BXW.shape != (B, X, W) or not window_BXW.is_contiguous()
            or weight_X1K.shape != (X, 1, W + 1) or weight_X1K.stride(2) != 1):
        raise ValueError(f"conv_step_triton takes one token, a contiguous window [B, X, W] and weights [X, 1, W + 1]; "
                         f"got mixed {tuple(mixed_BTX.shape)}, window {tuple(window_BXW.shape)}, weight "
                         f"{tuple(weight_X1K.shape)}")
    out_BTX = torch.empty(B, 1, X, dtype=mixed_BTX.dtype, device=mixed_BTX.device)
    block = 256
    with torch.cuda.device_of(mixed_BTX):
        _conv_step_kernel[(triton.cdiv(X, block), B)](
            mixed_BTX, window_BXW, weight_X1K, out_BTX, X, mixed_BTX.stride(0), mixed_BTX.stride(2),
            weight_X1K.stride(0), W=W, WP=triton.next_power_of_2(W + 1), BX=block, num_warps=4)
    return out_BTX


def conv_supported(mixed_BTX, window_BXW) -> bool:
    """One token per response, a contiguous window, no input wider than fp32."""
    return (mixed_BTX.shape[1] == 1 and window_BXW.is_contiguous()
            and all(t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in (mixed_BTX, window_BXW)))


def supported(q_BTHK, v_BTGV, state_BGKV) -> bool:
    """One token per response, an fp32 contiguous state, inputs no wider than fp32, a key dim that fits."""
    return (q_BTHK.shape[1] == 1 and state_BGKV.dtype == torch.float32 and state_BGKV.is_contiguous()
            and q_BTHK.shape[-1] <= MAX_KEY_DIM
            and all(t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in (q_BTHK, v_BTGV)))


def gdn_decode_triton(q_BTHK, k_BTHK, v_BTGV, a_BTG, b_BTG, a_log_G, dt_bias_G, state_BGKV, scale=None,
                      eps: float = 1e-6):
    """`gdn_decode_reference`'s contract (T = 1, inputs any strides; see `supported`): -> o_BTGV in v's dtype;
    state_BGKV [B, G, K, V] fp32 advanced in place."""
    B, T, H, K = q_BTHK.shape
    G, V = v_BTGV.shape[2:]
    if not supported(q_BTHK, v_BTGV, state_BGKV) or state_BGKV.shape != (B, G, K, V) or G % H:
        raise ValueError(f"gdn_decode_triton takes one token, an fp32 contiguous state [B, G, K, V] and K <= "
                         f"{MAX_KEY_DIM}; got q {tuple(q_BTHK.shape)}, v {tuple(v_BTGV.shape)} {v_BTGV.dtype}, "
                         f"state {tuple(state_BGKV.shape)} {state_BGKV.dtype}")
    o_BTGV = torch.empty(B, T, G, V, dtype=v_BTGV.dtype, device=v_BTGV.device)
    q, k, v, o = q_BTHK[:, 0], k_BTHK[:, 0], v_BTGV[:, 0], o_BTGV[:, 0]
    a, b = a_BTG[:, 0], b_BTG[:, 0]
    with torch.cuda.device_of(v_BTGV):
        _decode_step_kernel[(triton.cdiv(V, BLOCK_V), B * G)](
            q, k, v, a, b, a_log_G, dt_bias_G, state_BGKV, o, *q.stride(), *k.stride(), *v.stride(), *a.stride(),
            *b.stride(), *o.stride()[:2], K**-0.5 if scale is None else scale, eps, GROUP=G // H, G=G, K=K, V=V,
            BK=max(16, triton.next_power_of_2(K)), BV=BLOCK_V, num_warps=NUM_WARPS)
    return o_BTGV
