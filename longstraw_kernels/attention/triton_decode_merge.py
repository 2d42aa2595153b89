"""The end of a qwen36 attention layer's decode step, for CUDA, in one launch: the pages' partials merged, then with
the response's partials, then the output gate.

The cascade (decode.py) leaves per response and query head N_p partials over ranges of the prompt's pages (flash's
output and lse) and N_r over ranges of the response's slots (fp32). The torch path merges the pages' partials by
log-sum-exp and rounds the result to the activations' dtype (`decode_pages_attention`), merges it with the
response's (`cascade_decode_attention`), rounds again, and multiplies by sigmoid(gate) (`GatedAttention.gated`):
under torch.compile 7 small kernels a layer (qwen36_mini at 256K, G=8 on an H200: 18.1 us of kernel time a layer,
docs/BENCHMARKS.md thirty-first session). Here one program a (response, query head) does all of it, with the same
two roundings and the gate's product rounded once (as the compiled step rounds it):

    o_p = round(sum_i exp(lse_i - LSE_p) out_i)                       over the pages' partials
    o   = round(exp(LSE_p - LSE) o_p + sum_j exp(lse_j - LSE) out_j)   LSE over LSE_p and the response's lse_j
    y   = round(o * sigmoid(gate))

A row with no finite lse anywhere comes out 0 (merge_partials' rule). The contract is `decode_merge_reference`;
tests/kernels/test_decode_merge.py holds the kernel to it in Triton's interpreter (CPU). Opt in
(LONGSTRAW_DECODE_MERGE=fused, qwen36/decode.py): passes its GPU tests; on an H200 no faster than the compiled
step's own merges (qwen36_mini 2.816 against 2.810 ms a step), hence opt in.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from longstraw_kernels.attention.decode import merge_pages_partials, merge_with_response

__all__ = ["decode_merge", "decode_merge_reference"]

# a constexpr: the compiled kernel reads no other globals
LOG2E = tl.constexpr(1.4426950408889634)


def decode_merge_reference(out_p_NKMD: torch.Tensor, lse_p_NKM: torch.Tensor, out_r_NBQD: torch.Tensor,
                           lse_r_NBQ: torch.Tensor, gate_BQD: torch.Tensor) -> torch.Tensor:
    """The contract, in torch: the cascade's two merges (`decode_pages_attention`'s and `cascade_decode_attention`'s
    own) and the gate (its product in fp32, rounded once).
    Pages' rows m = b * G + g of kv head k are query head k * G + g of response b. -> y [B, Q, D] in gate's dtype."""
    dtype = gate_BQD.dtype
    o_p_BQD, lse_p_BQ = merge_pages_partials(out_p_NKMD, lse_p_NKM.float(), gate_BQD.shape[0], dtype)
    o_BQD = merge_with_response(o_p_BQD, lse_p_BQ, out_r_NBQD, lse_r_NBQ, dtype)
    return (o_BQD.float() * torch.sigmoid(gate_BQD.float())).to(dtype)


@triton.jit
def _lse(lse_N, other):
    """log-sum-exp of the vector lse_N and the scalar `other` (-inf where every term is -inf)."""
    top = tl.maximum(tl.max(lse_N, 0), other)
    top = tl.where(top == float("-inf"), 0.0, top)
    return top + tl.log2(tl.sum(tl.exp2((lse_N - top) * LOG2E), 0) + tl.exp2((other - top) * LOG2E)) / LOG2E


@triton.jit
def _add_weighted(acc, out_row, lse_row, s_out_n, s_lse_n, N, lse_all, D: tl.constexpr, CHUNK: tl.constexpr):
    """acc + sum_n exp(lse_n - lse_all) out_n over one row's N partials (out_row, lse_row: its first partial's),
    CHUNK partials at a time."""
    base = tl.where(lse_all == float("-inf"), 0.0, lse_all)
    ic, d = tl.arange(0, CHUNK), tl.arange(0, D)
    for n0 in range(0, N, CHUNK):
        rows = n0 + ic
        ok = rows < N
        lse = tl.load(lse_row + rows * s_lse_n, mask=ok, other=float("-inf"))
        out = tl.load(out_row + rows[:, None].to(tl.int64) * s_out_n + d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(tl.exp2((lse - base) * LOG2E)[:, None] * out.to(tl.float32), 0)
    return acc


@triton.jit
def _merge_kernel(op_ptr, lp_ptr, or_ptr, lr_ptr, g_ptr, y_ptr, N_P, N_R, Q, G,
                  s_op_n, s_op_k, s_op_m, s_lp_n, s_lp_k, s_lp_m, s_or_n, s_or_b, s_or_q, s_lr_n, s_lr_b, s_lr_q,
                  s_g_b, s_g_q, s_y_b, s_y_q,
                  D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
    b, q = tl.program_id(0).to(tl.int64), tl.program_id(1)
    k, m = q // G, b * G + q % G
    d = tl.arange(0, D)
    dtype = y_ptr.dtype.element_ty
    # the pages' partials of this row (kv head k, row m), merged and rounded
    out_p, lse_p = op_ptr + k * s_op_k + m * s_op_m, lp_ptr + k * s_lp_k + m * s_lp_m
    ip = tl.arange(0, BLOCK_P)
    LSE_p = _lse(tl.load(lse_p + ip * s_lp_n, mask=ip < N_P, other=float("-inf")), float("-inf"))
    o_p = _add_weighted(tl.zeros([D], dtype=tl.float32), out_p, lse_p, s_op_n, s_lp_n, N_P, LSE_p, D, CHUNK)
    o_p = o_p.to(dtype).to(tl.float32)
    # with the response's partials (response b, query head q), merged and rounded, then the gate
    out_r, lse_r = or_ptr + b * s_or_b + q * s_or_q, lr_ptr + b * s_lr_b + q * s_lr_q
    ir = tl.arange(0, BLOCK_R)
    LSE = _lse(tl.load(lse_r + ir * s_lr_n, mask=ir < N_R, other=float("-inf")), LSE_p)
    o = tl.exp2((LSE_p - tl.where(LSE == float("-inf"), 0.0, LSE)) * LOG2E) * o_p
    o = _add_weighted(o, out_r, lse_r, s_or_n, s_lr_n, N_R, LSE, D, CHUNK).to(dtype).to(tl.float32)
    gate = tl.load(g_ptr + b * s_g_b + q * s_g_q + d).to(tl.float32)
    tl.store(y_ptr + b * s_y_b + q * s_y_q + d, (o * tl.sigmoid(gate)).to(dtype))


def decode_merge(out_p_NKMD: torch.Tensor, lse_p_NKM: torch.Tensor, out_r_NBQD: torch.Tensor,
                 lse_r_NBQ: torch.Tensor, gate_BQD: torch.Tensor) -> torch.Tensor:
    """`decode_merge_reference`'s contract, one launch (strided views are fine: the last dims contiguous)."""
    with contextlib.nullcontext() if torch.compiler.is_compiling() else torch.cuda.device_of(gate_BQD):
        return _merge_op(out_p_NKMD, lse_p_NKM.float(), out_r_NBQD, lse_r_NBQ, gate_BQD)


# opaque to the compiler, as the decode's other kernels (triton_decode_response.py says why)
@torch.library.custom_op("longstraw::decode_merge", mutates_args=())
def _merge_op(out_p_NKMD: torch.Tensor, lse_p_NKM: torch.Tensor, out_r_NBQD: torch.Tensor, lse_r_NBQ: torch.Tensor,
              gate_BQD: torch.Tensor) -> torch.Tensor:
    N_P, K, _, D = out_p_NKMD.shape
    N_R, B, Q, _ = out_r_NBQD.shape
    y_BQD = gate_BQD.new_empty(B, Q, D)
    _merge_kernel[(B, Q)](
        out_p_NKMD, lse_p_NKM, out_r_NBQD, lse_r_NBQ, gate_BQD, y_BQD, N_P, N_R, Q, Q // K,
        *out_p_NKMD.stride()[:3], *lse_p_NKM.stride(), *out_r_NBQD.stride()[:3], *lse_r_NBQ.stride(),
        *gate_BQD.stride()[:2], *y_BQD.stride()[:2],
        D=D, BLOCK_P=max(16, triton.next_power_of_2(N_P)), BLOCK_R=max(16, triton.next_power_of_2(N_R)), CHUNK=8,
        num_warps=4)
    return y_BQD


@_merge_op.register_fake
def _(out_p_NKMD, lse_p_NKM, out_r_NBQD, lse_r_NBQ, gate_BQD):
    return gate_BQD.new_empty(*gate_BQD.shape)
