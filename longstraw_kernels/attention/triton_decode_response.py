"""The response part of a decode step's cascade attention, for CUDA: each response's query against its own keys.

A decode step keeps each response's generated keys/values in a preallocated buffer [B, S, K, D] whose first
`filled` slots hold tokens (the rest zeros, grown with the response: models/slots.py). The torch reference
(decode.py) upcasts the whole buffer to fp32 and masks the empty slots, so a step costs the capacity S, not the
tokens made so far: on an H200 at qwen36_mini's shape (G=8, 16,384 slots) that was 4 ms of copies and 2.5 ms of
fp32 products in a 16 ms step. This kernel reads only the filled slots, in the buffer's dtype and in place:

    s_j = scale q.k_j (bf16 operands, fp32 accumulation),  lse = log sum_j exp(s_j),  out = sum_j exp(s_j - lse) v_j

A program owns one response's kv head, its G query heads as rows (padded to tl.dot's 16), and one range of slots,
walked BLOCK_S at a time with an online softmax (the probabilities rounded to the operand dtype for the second
product, as flash attention does). The slot ranges (`splits`, a fixed count so that a compiled step does not
depend on the capacity) are cut from S; `filled` is read on the device, so a CUDA graph replays the same launch
at every step and a range past the filled slots does no work (out 0, lse -inf). The ranges merge by
log-sum-exp (decode.merge_partials) with one another and with the prompt pages' part.

Checked against the fp64 reference by tests/kernels/test_gpu.py (CUDA, bf16) and tests/kernels/
test_decode_response.py (Triton's interpreter on CPU; there the products run in fp32, as the interpreter's bf16
tl.dot is wrong).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

__all__ = ["response_partials"]

LOG2E = 1.4426950408889634
BLOCK_S = 64
# thread blocks to aim for: a few per SM of an H100/H200 (132 SMs)
TARGET_PROGRAMS = 512


@triton.jit
def _response_kernel(q_ptr, k_ptr, v_ptr, filled_ptr, out_ptr, lse_ptr, K, G, slots_per_split,
                     stride_qb, stride_qq, stride_kb, stride_ks, stride_kk, stride_os, stride_ls, scale_log2e,
                     D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, INTERPRETED: tl.constexpr):
    bk, split = tl.program_id(0), tl.program_id(1)
    b, h = bk // K, bk % K
    rows = tl.arange(0, BLOCK_G)
    row_ok = rows < G
    cols = tl.arange(0, D)
    # query heads h*G .. h*G + G - 1 of response b are the rows
    q_off = b.to(tl.int64) * stride_qb + (h * G + rows[:, None]).to(tl.int64) * stride_qq + cols[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    if INTERPRETED:  # Triton 3.9's interpreter returns garbage from a bf16 tl.dot: fp32 operands there
        q = q.to(tl.float32)
    filled = tl.load(filled_ptr)
    begin = split * slots_per_split
    end = tl.minimum(filled, begin + slots_per_split)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    kv_base = b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kk
    for s0 in range(begin, end, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        ok = slots < end
        kv_off = kv_base + slots[:, None].to(tl.int64) * stride_ks + cols[None, :]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0)
        if INTERPRETED:
            k, v = k.to(tl.float32), v.to(tl.float32)
        # scores in log2 units; slot s0 < end, so every row has a finite maximum from the first block on
        # (fp32 also where a compiled step passes the scale as a wider constant)
        s = tl.where(ok[None, :], (tl.dot(q, tl.trans(k)) * scale_log2e).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    some = total > 0
    out = acc / tl.where(some, total, 1.0)[:, None]
    lse = tl.where(some, (m + tl.log2(tl.where(some, total, 1.0))) * 0.6931471805599453, float("-inf"))
    out_off = (split.to(tl.int64) * stride_os + bk.to(tl.int64) * G * D + rows[:, None].to(tl.int64) * D
               + cols[None, :])
    tl.store(out_ptr + out_off, out, mask=row_ok[:, None])
    tl.store(lse_ptr + split.to(tl.int64) * stride_ls + bk * G + rows, lse, mask=row_ok)


def response_partials(q_BQD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, filled_1: torch.Tensor, *,
                      scale: float, splits: int | None = None):
    """Partials over `splits` slot ranges of the first `filled_1` (a device int tensor [1]) slots.
    -> (out [splits, B, Q, D] fp32, lse [splits, B, Q] fp32); a range with no filled slot is out 0, lse -inf."""
    B = q_BQD.shape[0]
    K = k_BSKD.shape[2]
    assert k_BSKD.stride(-1) == 1 and v_BSKD.stride() == k_BSKD.stride()
    splits = splits or max(1, TARGET_PROGRAMS // (B * K))
    # Triton launches on the current device, q's may be another (a no-op for CPU tensors, in the interpreter); a
    # compiled step (the decode's) leaves the placement to inductor
    with contextlib.nullcontext() if torch.compiler.is_compiling() else torch.cuda.device_of(q_BQD):
        return _response_op(q_BQD.contiguous(), k_BSKD, v_BSKD, filled_1, scale, splits)


# an opaque torch op around the launch, so that the compiled decode step (qwen36/decode.py) calls the kernel as it
# is, with the capacity S a dynamic size. Not a `triton_op`: inductor's own launch of the decode linear kernel ran
# 2.3x slower than the opaque op's (linear/triton_skinny.py)
@torch.library.custom_op("longstraw::decode_response_partials", mutates_args=())
def _response_op(q_BQD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, filled_1: torch.Tensor,
                 scale: float, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, Q, D = q_BQD.shape
    S, K = k_BSKD.shape[1:3]
    G = Q // K
    # whole BLOCK_S blocks per range: a range never reads a slot of the next one
    slots_per_split = triton.cdiv(triton.cdiv(S, splits), BLOCK_S) * BLOCK_S
    out = q_BQD.new_empty(splits, B, Q, D, dtype=torch.float32)
    lse = q_BQD.new_empty(splits, B, Q, dtype=torch.float32)
    _response_kernel[(B * K, splits)](
        q_BQD, k_BSKD, v_BSKD, filled_1, out, lse, K, G, slots_per_split,
        q_BQD.stride(0), q_BQD.stride(1), k_BSKD.stride(0), k_BSKD.stride(1), k_BSKD.stride(2),
        out.stride(0), lse.stride(0), scale * LOG2E,
        D=D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_S=BLOCK_S,
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", num_warps=4)
    return out, lse


@_response_op.register_fake
def _(q_BQD, k_BSKD, v_BSKD, filled_1, scale, splits):
    B, Q, D = q_BQD.shape
    return (q_BQD.new_empty(splits, B, Q, D, dtype=torch.float32), q_BQD.new_empty(splits, B, Q, dtype=torch.float32))
