"""The query and key preparation of a qwen36 attention layer's decode step, for CUDA, in one launch.

After the layer's input GEMM a decode step has, per response, the query heads with their output gates interleaved
([Q, 2 D]: each head's query, then its gate), the kv heads' keys and values. The model's path (qwen36/model.py
`project_from`, then the decoder's cache writes) runs the query norm, the key norm, partial RoPE on each, and two
index copies into the response slots: under torch.compile 8 small kernels a layer (qwen36_mini at 256K, G=8 on an
H200: 14.5 us of kernel time a layer, docs/BENCHMARKS.md, 2026-12-04). Here one program a (response, head):

    query head h < Q:  q[b, h] = rope(rmsnorm_1p(qg[b, h, :D], w_q))
    kv head j = h - Q: k_slots[b, step, j] = rope(rmsnorm_1p(k[b, j], w_k)),  v_slots[b, step, j] = v[b, j]

rmsnorm_1p: fp32 RMSNorm times (1 + w), rounded to the activations' dtype (linear/reference.py
`rms_norm_one_plus`); rope: the first 2 * HALF dims rotated by the step's cos and sin (given, in the activations'
dtype, as the model computes them: `rope_cos_sin`), in fp32 and rounded once, as the compiled step rounds it
(eager torch rounds each product first). A dim's rotation partner is reloaded and normalised again (its norm's
factor is the row's, a scalar), rather than moved between registers. The step is read on the device, so a CUDA
graph replays one launch at every step.

The contract is `decode_qk_reference`; tests/kernels/test_decode_qk.py holds the kernel to it in Triton's
interpreter (CPU) and on CUDA (`-m gpu`). qwen36's decode takes it by default where it serves
(`kernels.decode_qk=torch`: the modules; qwen36_mini's step on an H200 2.912 -> 2.844 ms in `longstraw train`).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from longstraw_kernels.linear.reference import rms_norm_one_plus

__all__ = ["decode_qk", "decode_qk_reference"]


def decode_qk_reference(qg_BX: torch.Tensor, k_BX: torch.Tensor, v_BX: torch.Tensor, w_q: torch.Tensor,
                        w_k: torch.Tensor, eps: float, cos_R: torch.Tensor, sin_R: torch.Tensor, step_1: torch.Tensor,
                        k_BSKD: torch.Tensor, v_BSKD: torch.Tensor) -> torch.Tensor:
    """The contract, in torch: the normalised, rotated queries [B, Q, D]; the keys (normalised, rotated) and the
    values written to slot `step_1` (a device int tensor [1]) of k_BSKD / v_BSKD. The rotation in fp32 from the
    rounded norms and cos / sin, rounded once."""
    B, K, D = k_BSKD.shape[0], k_BSKD.shape[2], k_BSKD.shape[3]
    q_BQD = qg_BX.reshape(B, -1, 2 * D)[..., :D]

    def rope(x):
        rot = cos_R.shape[-1]
        h = x.float()
        half = rot // 2
        turned = torch.cat([-h[..., half:rot], h[..., :half]], dim=-1)
        return torch.cat([h[..., :rot] * cos_R.float() + turned * sin_R.float(), h[..., rot:]], dim=-1).to(x.dtype)

    k_BKD = rope(rms_norm_one_plus(k_BX.reshape(B, K, D), w_k, eps))
    k_BSKD.index_copy_(1, step_1, k_BKD[:, None].to(k_BSKD.dtype))
    v_BSKD.index_copy_(1, step_1, v_BX.reshape(B, 1, K, D).to(v_BSKD.dtype))
    return rope(rms_norm_one_plus(q_BQD, w_q, eps))


@triton.jit
def _norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, eps, D: tl.constexpr, HALF: tl.constexpr):
    """One head [D] at x_ptr: rmsnorm_1p, then the first 2 * HALF dims rotated; stored at out_ptr."""
    dtype = out_ptr.dtype.element_ty
    d = tl.arange(0, D)
    x = tl.load(x_ptr + d).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    h = (x * scale * (1.0 + tl.load(w_ptr + d).to(tl.float32))).to(dtype).to(tl.float32)
    rot = d < 2 * HALF
    # rotate_half: dim d < HALF takes -x[d + HALF], HALF <= d < 2 HALF takes x[d - HALF]
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    x_p = tl.load(x_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    w_p = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    h_p = (x_p * scale * (1.0 + w_p)).to(dtype).to(tl.float32)
    turned = tl.where(d < HALF, -h_p, h_p)
    c = tl.load(cos_ptr + d, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + d, mask=rot, other=0.0).to(tl.float32)
    tl.store(out_ptr + d, tl.where(rot, h * c + turned * s, h).to(dtype))


@triton.jit
def _qk_kernel(qg_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, step_ptr, q_out_ptr, kc_ptr, vc_ptr, Q,
               stride_qgb, stride_kb, stride_vb, stride_qob, stride_kcb, stride_kcs, stride_kck, stride_vcb, stride_vcs,
               stride_vck, eps, D: tl.constexpr, HALF: tl.constexpr):
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if h < Q:
        _norm_rope(qg_ptr + b * stride_qgb + h * 2 * D, wq_ptr, cos_ptr, sin_ptr, q_out_ptr + b * stride_qob + h * D,
                   eps, D, HALF)
    else:
        j = h - Q
        step = tl.load(step_ptr)
        _norm_rope(k_ptr + b * stride_kb + j * D, wk_ptr, cos_ptr, sin_ptr,
                   kc_ptr + b * stride_kcb + step * stride_kcs + j * stride_kck, eps, D, HALF)
        d = tl.arange(0, D)
        v = tl.load(v_ptr + b * stride_vb + j * D + d)
        tl.store(vc_ptr + b * stride_vcb + step * stride_vcs + j * stride_vck + d, v.to(vc_ptr.dtype.element_ty))


def decode_qk(qg_BX: torch.Tensor, k_BX: torch.Tensor, v_BX: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor,
              eps: float, cos_R: torch.Tensor, sin_R: torch.Tensor, step_1: torch.Tensor, k_BSKD: torch.Tensor,
              v_BSKD: torch.Tensor) -> torch.Tensor:
    """`decode_qk_reference`'s contract, one launch. qg_BX, k_BX, v_BX: [B, ...] rows (views of one GEMM's output
    are fine: the last dim contiguous)."""
    B = qg_BX.shape[0]
    rows = [t.reshape(B, -1) for t in (qg_BX, k_BX, v_BX)]
    rows = [t if t.stride(-1) == 1 else t.contiguous() for t in rows]
    with contextlib.nullcontext() if torch.compiler.is_compiling() else torch.cuda.device_of(qg_BX):
        return _qk_op(*rows, w_q, w_k, eps, cos_R.reshape(-1), sin_R.reshape(-1), step_1, k_BSKD, v_BSKD)


# opaque to the compiler, as the decode's other kernels (triton_decode_response.py says why)
@torch.library.custom_op("longstraw::decode_qk", mutates_args=("k_BSKD", "v_BSKD"))
def _qk_op(qg_BX: torch.Tensor, k_BX: torch.Tensor, v_BX: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor,
           eps: float, cos_R: torch.Tensor, sin_R: torch.Tensor, step_1: torch.Tensor, k_BSKD: torch.Tensor,
           v_BSKD: torch.Tensor) -> torch.Tensor:
    B, _, K, D = k_BSKD.shape
    Q = qg_BX.shape[1] // (2 * D)
    q_BQD = qg_BX.new_empty(B, Q, D)
    _qk_kernel[(B, Q + K)](
        qg_BX, k_BX, v_BX, w_q, w_k, cos_R, sin_R, step_1, q_BQD, k_BSKD, v_BSKD, Q,
        qg_BX.stride(0), k_BX.stride(0), v_BX.stride(0), q_BQD.stride(0), *k_BSKD.stride()[:3], *v_BSKD.stride()[:3],
        eps, D=D, HALF=cos_R.shape[0] // 2, num_warps=2)
    return q_BQD


@_qk_op.register_fake
def _(qg_BX, k_BX, v_BX, w_q, w_k, eps, cos_R, sin_R, step_1, k_BSKD, v_BSKD):
    B, _, _, D = k_BSKD.shape
    return qg_BX.new_empty(B, qg_BX.shape[1] // (2 * D), D)
