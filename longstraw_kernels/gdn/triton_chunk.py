"""The chunked gated delta rule with a backward, for CUDA: `gdn_chunked`'s contract, the scan over chunks in Triton.

`gdn_chunked` spends its time in a Python loop over the N = T / C chunks (a few small launches a chunk, forward and
backward). Here the loop is two Triton kernels and everything else is batched torch over all chunks at once
(derivation of the adjoint in README.md, "The Triton op"):

    forward   torch chunk_terms (reference.py, shared) -> Triton _scan_fwd_kernel: chunk-start states S_n and
              U_n -> torch O_n = q_decayed_n S_n + attn_n U_n
    backward  torch chunk_terms again, with a graph; Triton _scan_fwd_kernel again (S_n, U_n); torch the
              gradients that reach S_n and U_n from O; Triton _scan_bwd_kernel: dU_n and dS_{n+1} chunk by chunk
              backwards, dS_0; torch the terms' gradients (batched products), then autograd through chunk_terms

A kernel program owns one head and BV of its value columns (columns never mix): B G ceil(V / BV) programs, each
walking its head's N chunks with its [K, BV] slice of the state in registers.

Memory: the Function saves its inputs only. The backward recomputes chunk_terms (with a graph) and the chunk-start
states S_n (the forward kernel again) instead of keeping them between forward and backward: at qwen36_mini's GDN
shape the states alone are 16 KiB a token (fp32 [G, K, V] every 64 tokens), twice the bf16 q, k, v. What the
backward holds for the time it runs is O(T): the terms' graph, S_n, U_n and their gradients, all fp32. Measured
(bench_gdn_bwd.py, one H200, qwen36_mini, T = 64K): one forward + backward peaks 16.5 GiB above its inputs,
gdn_chunked's autograd 12.3 GiB; between forward and backward this op holds nothing beyond its inputs.

Precision: q, k, v of fp32, bf16 or fp16 are computed in fp32 (`compute_dtype`), as by gdn_chunked; the kernels
take fp32 operands with input_precision="ieee" (no TF32). o comes back in v's dtype, the final state in fp32, each
gradient in its input's dtype. fp64 is the reference's (`supported` says no).

Shape legend (kernels see B G flattened into heads):
    B batch, T time, H key heads, G value heads, K key dim, V value dim, N chunks, C chunk size,
    BV value columns per kernel program
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from longstraw_kernels import compute_dtype
from longstraw_kernels.gdn.reference import ChunkTerms, chunk_terms, prepare_inputs

__all__ = ["DEFAULT_CONFIG", "ScanConfig", "TritonGDN", "gdn_chunked_triton", "scan_backward", "scan_forward",
           "supported"]


@dataclass(frozen=True)
class ScanConfig:
    block_v: int  # value columns per program (>= 16: tl.dot's minimum)
    num_warps: int
    num_stages: int


# 16 value columns, 8 warps, one stage: on one H200 at qwen36_mini's shape and T = 64K (bench_gdn_bwd.py --sweep)
# the forward and backward scans took 9.2 and 9.6 ms (two stages: 8.6 and 8.8, not yet run by the GPU tests); the
# other configs swept (4 or 16 warps, 32 or 64 columns) took 31-280 ms. Not profiled: register pressure from the
# fp32 [C, K] tiles of w_k and k_to_end (32 KiB each at C = 64, K = 128) is the likely cause.
DEFAULT_CONFIG = ScanConfig(16, 8, 1)


@triton.jit
def _scan_fwd_kernel(w_k_ptr, w_v_ptr, k_end_ptr, decay_ptr, state0_ptr, u_ptr, states_ptr, final_ptr, N,
                     K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, K_PAD: tl.constexpr, BV: tl.constexpr,
                     HAS_STATE0: tl.constexpr):
    # one program: head `head`, value columns [pid_v BV, (pid_v + 1) BV); padded rows and columns stay zero
    head = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, K_PAD)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    kv = offs_k[:, None] * V + offs_v[None, :]  # [K_PAD, BV] within one [K, V] state
    ck = offs_c[:, None] * K + offs_k[None, :]  # [C, K_PAD] within one chunk
    cv = offs_c[:, None] * V + offs_v[None, :]  # [C, BV]

    if HAS_STATE0:
        state = tl.load(state0_ptr + head * K * V + kv, mask=mask_kv, other=0.0)
    else:
        state = tl.zeros([K_PAD, BV], tl.float32)
    for n in range(N):
        chunk = head * N + n
        tl.store(states_ptr + chunk * K * V + kv, state, mask=mask_kv)
        w_k = tl.load(w_k_ptr + chunk * C * K + ck, mask=mask_k[None, :], other=0.0)
        w_v = tl.load(w_v_ptr + chunk * C * V + cv, mask=mask_v[None, :], other=0.0)
        k_end = tl.load(k_end_ptr + chunk * C * K + ck, mask=mask_k[None, :], other=0.0)
        decay = tl.load(decay_ptr + chunk)
        u = w_v - tl.dot(w_k, state, input_precision="ieee")  # [C, BV]
        tl.store(u_ptr + chunk * C * V + cv, u, mask=mask_v[None, :])
        state = state * decay + tl.dot(tl.trans(k_end), u, input_precision="ieee")
    tl.store(final_ptr + head * K * V + kv, state, mask=mask_kv)


@triton.jit
def _scan_bwd_kernel(w_k_ptr, k_end_ptr, decay_ptr, du_ext_ptr, dstates_ext_ptr, dfinal_ptr, du_ptr,
                     dstates_end_ptr, dstate0_ptr, N,
                     K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, K_PAD: tl.constexpr, BV: tl.constexpr,
                     HAS_DFINAL: tl.constexpr):
    # du may alias du_ext and dstates_end dstates_ext: each element is read before this program writes it
    head = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, K_PAD)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    kv = offs_k[:, None] * V + offs_v[None, :]
    ck = offs_c[:, None] * K + offs_k[None, :]
    cv = offs_c[:, None] * V + offs_v[None, :]

    # dstate: the gradient of the state after chunk n (dS_{n+1}), walking n down from N - 1
    if HAS_DFINAL:
        dstate = tl.load(dfinal_ptr + head * K * V + kv, mask=mask_kv, other=0.0)
    else:
        dstate = tl.zeros([K_PAD, BV], tl.float32)
    for i in range(N):
        chunk = head * N + (N - 1 - i)
        dstate_ext = tl.load(dstates_ext_ptr + chunk * K * V + kv, mask=mask_kv, other=0.0)
        du_ext = tl.load(du_ext_ptr + chunk * C * V + cv, mask=mask_v[None, :], other=0.0)
        k_end = tl.load(k_end_ptr + chunk * C * K + ck, mask=mask_k[None, :], other=0.0)
        w_k = tl.load(w_k_ptr + chunk * C * K + ck, mask=mask_k[None, :], other=0.0)
        decay = tl.load(decay_ptr + chunk)
        tl.store(dstates_end_ptr + chunk * K * V + kv, dstate, mask=mask_kv)
        du = du_ext + tl.dot(k_end, dstate, input_precision="ieee")  # [C, BV]
        tl.store(du_ptr + chunk * C * V + cv, du, mask=mask_v[None, :])
        dstate = dstate * decay - tl.dot(tl.trans(w_k), du, input_precision="ieee") + dstate_ext
    tl.store(dstate0_ptr + head * K * V + kv, dstate, mask=mask_kv)


def supported(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, chunk_size=64) -> bool:
    """Inputs the op takes: compute dtype fp32 (no input wider), at least one token, chunk_size a power of two
    >= 16 (tl.dot's minimum). Device placement is the dispatcher's concern (the interpreter runs these on CPU)."""
    return (compute_dtype(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV) == torch.float32
            and v_BTGV.shape[1] > 0 and v_BTGV.shape[-1] > 0
            and chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0)


def _launch_meta(w_k_BGNCK, w_v_BGNCV, config):
    """-> (grid, kernel meta-parameters) for [B, G, N, C, K] terms and V value columns."""
    B, G, _, C, K = w_k_BGNCK.shape
    V = w_v_BGNCV.shape[-1]
    config = config or DEFAULT_CONFIG
    meta = dict(K=K, V=V, C=C, K_PAD=max(16, triton.next_power_of_2(K)), BV=config.block_v,
                num_warps=config.num_warps, num_stages=config.num_stages)
    # heads on the first grid axis: the second is limited to 65535
    return (B * G, triton.cdiv(V, config.block_v)), meta


def scan_forward(terms: ChunkTerms, state_BGKV, config: ScanConfig | None = None):
    """The sequential part of the forward, no autograd. -> (u_BGNCV, chunk-start states_BGNKV, final_BGKV),
    fp32; state_BGKV None is a zero initial state."""
    w_k_BGNCK, w_v_BGNCV, k_end_BGNCK = (t.detach().contiguous() for t in
                                         (terms.w_k_BGNCK, terms.w_v_BGNCV, terms.k_to_end_BGNCK))
    decay_BGN = terms.chunk_decay_BGN.detach().contiguous()
    B, G, N, C, K = w_k_BGNCK.shape
    V = w_v_BGNCV.shape[-1]
    u_BGNCV = torch.empty_like(w_v_BGNCV)
    states_BGNKV = w_v_BGNCV.new_empty(B, G, N, K, V)
    final_BGKV = w_v_BGNCV.new_empty(B, G, K, V)
    state0_BGKV = None if state_BGKV is None else state_BGKV.detach().float().contiguous()
    grid, meta = _launch_meta(w_k_BGNCK, w_v_BGNCV, config)
    # Triton launches on the current device; the inputs' may be another (a no-op for CPU tensors)
    with torch.cuda.device_of(w_v_BGNCV):
        _scan_fwd_kernel[grid](w_k_BGNCK, w_v_BGNCV, k_end_BGNCK, decay_BGN,
                               final_BGKV if state0_BGKV is None else state0_BGKV,
                               u_BGNCV, states_BGNKV, final_BGKV, N, HAS_STATE0=state0_BGKV is not None, **meta)
    return u_BGNCV, states_BGNKV, final_BGKV


def scan_backward(terms: ChunkTerms, du_ext_BGNCV, dstates_ext_BGNKV, dfinal_BGKV, config: ScanConfig | None = None):
    """The sequential part of the backward, no autograd. Given the gradients that reach U_n and S_n directly
    (from O) and the final state's (None: zero) -> (dU_BGNCV total, dstates_end_BGNKV: the gradient of the state
    after each chunk, dstate0_BGKV). Overwrites du_ext_BGNCV and dstates_ext_BGNKV with the first two."""
    w_k_BGNCK, k_end_BGNCK = (t.detach().contiguous() for t in (terms.w_k_BGNCK, terms.k_to_end_BGNCK))
    decay_BGN = terms.chunk_decay_BGN.detach().contiguous()
    assert du_ext_BGNCV.is_contiguous() and dstates_ext_BGNKV.is_contiguous()
    B, G, N, C, K = w_k_BGNCK.shape
    V = du_ext_BGNCV.shape[-1]
    dstate0_BGKV = du_ext_BGNCV.new_empty(B, G, K, V)
    dfinal_BGKV = None if dfinal_BGKV is None else dfinal_BGKV.float().contiguous()
    grid, meta = _launch_meta(w_k_BGNCK, du_ext_BGNCV, config)
    with torch.cuda.device_of(du_ext_BGNCV):
        _scan_bwd_kernel[grid](w_k_BGNCK, k_end_BGNCK, decay_BGN, du_ext_BGNCV, dstates_ext_BGNKV,
                               dstate0_BGKV if dfinal_BGKV is None else dfinal_BGKV,
                               du_ext_BGNCV, dstates_ext_BGNKV, dstate0_BGKV, N,
                               HAS_DFINAL=dfinal_BGKV is not None, **meta)
    return du_ext_BGNCV, dstates_ext_BGNKV, dstate0_BGKV


def _output(terms: ChunkTerms, u_BGNCV, states_BGNKV, T: int):
    """O_n = q_decayed_n S_n + attn_n U_n for every chunk, unpadded -> o_BGTV fp32."""
    o_BGNCV = terms.q_decayed_BGNCK @ states_BGNKV + terms.attn_BGNCC @ u_BGNCV
    B, G, N, C, V = o_BGNCV.shape
    return o_BGNCV.reshape(B, G, N * C, V)[:, :, :T]


class TritonGDN(torch.autograd.Function):
    """gdn_chunked's contract (see the module docstring for the split between torch and Triton); saves the
    inputs only."""

    @staticmethod
    def forward(ctx, q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale, chunk_size, forward_fn):
        ctx.save_for_backward(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        ctx.set_materialize_grads(False)
        if forward_fn is not None:
            o_BTGV, final_BGKV = forward_fn(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale)
            return o_BTGV.to(v_BTGV.dtype), final_BGKV.float()
        q_BGTK, k_BGTK, v_BGTV, g_BGT, beta_BGT, state_BGKV = prepare_inputs(
            q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale)
        terms = chunk_terms(q_BGTK, k_BGTK, v_BGTV, g_BGT, beta_BGT, chunk_size)
        u_BGNCV, states_BGNKV, final_BGKV = scan_forward(terms, None if initial_state_BGKV is None else state_BGKV)
        o_BGTV = _output(terms, u_BGNCV, states_BGNKV, v_BTGV.shape[1])
        return o_BGTV.transpose(1, 2).contiguous().to(v_BTGV.dtype), final_BGKV

    @staticmethod
    def backward(ctx, do_BTGV, dfinal_BGKV):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[:6]
        if (do_BTGV is None and dfinal_BGKV is None) or not any(needs):
            return (None,) * 9
        leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        with torch.enable_grad():
            q_BGTK, k_BGTK, v_BGTV, g_BGT, beta_BGT, state_BGKV = prepare_inputs(*leaves, ctx.scale)
            terms = chunk_terms(q_BGTK, k_BGTK, v_BGTV, g_BGT, beta_BGT, ctx.chunk_size)
        u_BGNCV, states_BGNKV, _ = scan_forward(terms, None if inputs[5] is None else state_BGKV)

        B, G, N, C, V = u_BGNCV.shape
        T = v_BGTV.shape[2]
        if do_BTGV is None:
            do_BGNCV = u_BGNCV.new_zeros(B, G, N, C, V)
        else:
            do_BGTV = do_BTGV.transpose(1, 2).float()
            do_BGNCV = torch.nn.functional.pad(do_BGTV, (0, 0, 0, N * C - T)).reshape(B, G, N, C, V)
        attn_BGNCC, q_decayed_BGNCK = terms.attn_BGNCC.detach(), terms.q_decayed_BGNCK.detach()
        du_BGNCV, dstates_end_BGNKV, dstate0_BGKV = scan_backward(
            terms, attn_BGNCC.transpose(-1, -2) @ do_BGNCV, q_decayed_BGNCK.transpose(-1, -2) @ do_BGNCV,
            dfinal_BGKV)

        # each term's gradient, formed only where the term leads to an input that needs one
        term_grads = [
            (terms.w_v_BGNCV, lambda: du_BGNCV),
            (terms.w_k_BGNCK, lambda: -(du_BGNCV @ states_BGNKV.transpose(-1, -2))),
            (terms.k_to_end_BGNCK, lambda: u_BGNCV @ dstates_end_BGNKV.transpose(-1, -2)),
            (terms.chunk_decay_BGN, lambda: (states_BGNKV * dstates_end_BGNKV).sum((-1, -2))),
            (terms.q_decayed_BGNCK, lambda: do_BGNCV @ states_BGNKV.transpose(-1, -2)),
            (terms.attn_BGNCC, lambda: do_BGNCV @ u_BGNCV.transpose(-1, -2)),
            (state_BGKV, lambda: dstate0_BGKV),
        ]
        outputs, grad_outputs = zip(*[(t, grad()) for t, grad in term_grads if t.requires_grad])
        wanted = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
        grads = iter(torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True))
        input_grads = []
        for leaf in leaves:
            if leaf is None or not leaf.requires_grad:
                input_grads.append(None)
            else:
                grad = next(grads)
                input_grads.append(torch.zeros_like(leaf) if grad is None else grad)
        return (*input_grads, None, None, None)


def gdn_chunked_triton(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, scale=None,
                       chunk_size=64, forward=None):
    """gdn_chunked's contract and gradients (every input, the initial state included; the final state's gradient
    flows back) for inputs `supported` takes. -> (o_BTGV in v's dtype, final_state_BGKV fp32).
    forward: a graph-free function under the same contract (fla's chunked kernel: fla_gpu.fla_chunk) that gives the
    forward values instead of this op's own scan; the backward is this op's either way (it recomputes its terms)."""
    if not supported(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, chunk_size):
        raise ValueError(f"gdn_chunked_triton takes fp32 compute (fp32/bf16/fp16 inputs), T >= 1 and a chunk_size "
                         f"that is a power of two >= 16; got v {tuple(v_BTGV.shape)} {v_BTGV.dtype}, "
                         f"chunk_size={chunk_size}")
    return TritonGDN.apply(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale, chunk_size, forward)
