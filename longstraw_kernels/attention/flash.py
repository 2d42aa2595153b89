"""Replay attention on CUDA: fused attention kernels that return the LSE, for the forward and the backward.

Forward: one kernel call for the causal new keys, one for the pages (a batch of page ranges when the query rows
alone would leave SMs idle: `attend_pages`), merged by LSE. Pages have no mask, so a kv
group's query heads and the batch fold into the query axis against the pages ([1, K, B*G*R, D] x [1, K, P, D]):
pages are never expanded to the query heads. The new keys are causal, so they are expanded to the query heads
instead; they are one response long. Causal masks differ between kernels in alignment (top-left in aten,
bottom-right in flash-attn >= 2.1); both agree when R == S, and R == 1 needs no mask: other shapes take the
reference.

Backward: the new keys through cuDNN's attention backward where the forward is cuDNN's (aten's flash backward
otherwise, or for a shape cuDNN refuses), called with the GLOBAL out and lse (the ring-attention identity, see
README.md): it recomputes its part's probabilities exactly and gives dq, and dk/dv of that part. The pages, where
the head dim is a power of two: triton_page_tiles.py when they need gradients (exact mode's walk: all five products,
in tiles a chunk of pages at a time), triton_page_dq.py when they are frozen (every response-only replay: their share
of dq alone, three of the five products); neither keeps a page-sized temporary. Other head dims take the kernel's
own backward over chunks of `BACKWARD_PAGE_CHUNK` pages (`attend_pages_backward`). The kernels take no cotangent
for the lse, so when the lse itself is used (context-parallel merges) the backward is the reference's.

Forward kernels (`kernels.attention` = auto | flash_attn | cudnn | flash):
- flash_attn: the flash-attn package, when installed (source-only: it is imported lazily and never required);
- cudnn: aten's cuDNN attention (about twice aten flash's rate at head dim 256 on an H200);
- flash: aten's flash attention, present in every CUDA build of torch.
auto takes the first available of these in that order. A cuDNN call that cuDNN refuses for a shape falls back to
aten flash for that call (logged once).

Legend: B batch, R queries, S new keys, P pages, Q query heads, K kv heads, G = Q // K, D head dim.
"""

from __future__ import annotations

import functools
import logging

import torch

from longstraw_kernels import at_least_fp32, kernel_choice
from longstraw_kernels.attention.reference import (
    _ReplayAttention,
    replay_attention_backward,
    save_for_replay_backward,
)

log = logging.getLogger(__name__)

FLASH_DTYPES = (torch.bfloat16, torch.float16)
FORWARD_BACKENDS = ("flash_attn", "cudnn", "flash")
BACKWARD_PAGE_CHUNK = 1 << 17


def triton_pages_supported(q_BRQD, k_pages_PKD, v_pages_PKD) -> bool:
    """Whether the Triton page kernels (triton_page_dq, triton_page_tiles) serve these pages: a power-of-two head
    dim (their tiles), k and v pages laid out alike and contiguous in D."""
    D = q_BRQD.shape[3]
    return (D >= 16 and D & (D - 1) == 0 and k_pages_PKD.stride(2) == 1
            and k_pages_PKD.stride() == v_pages_PKD.stride())


def flash_supported(q_BRQD, k_pages_PKD, k_new_BSKD) -> bool:
    R, D, S = q_BRQD.shape[1], q_BRQD.shape[3], k_new_BSKD.shape[1]
    # pages in host memory (offloaded) take the reference, which moves them block by block
    return (q_BRQD.is_cuda and k_pages_PKD.device == q_BRQD.device and q_BRQD.dtype in FLASH_DTYPES
            and k_pages_PKD.dtype == q_BRQD.dtype
            and k_new_BSKD.dtype == q_BRQD.dtype and D <= 256 and D % 8 == 0 and (S in (0, R) or R == 1))


@functools.cache
def flash_attn_func():
    """flash-attn's `flash_attn_func`, or None when the package is not installed (or does not import)."""
    try:
        from flash_attn import flash_attn_func as fn
    except Exception as exc:  # ImportError, or a build that does not match this torch / CUDA
        log.debug("flash-attn unavailable: %s", exc)
        return None
    return fn


def _cudnn_available() -> bool:
    return (torch.cuda.is_available() and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability() >= (9, 0))


def forward_backend() -> str:
    """The forward kernel to use, from kernels.attention (default auto)."""
    choice = kernel_choice("attention")
    if choice == "flash_attn" and flash_attn_func() is None:
        raise ImportError("kernels.attention=flash_attn but flash-attn is not importable; "
                          "install it (pip install flash-attn --no-build-isolation) or use auto")
    if choice != "auto":
        return choice
    if flash_attn_func() is not None:
        return "flash_attn"
    return "cudnn" if _cudnn_available() else "flash"


@functools.cache
def _warn_cudnn_fallback(reason: str) -> None:
    log.warning("cuDNN attention refused a shape (%s); using aten flash attention for such calls", reason)


def attend(q_BHLD, k_BHMD, v_BHMD, causal: bool, scale: float, backend: str):
    """-> (out_BHLD in q's dtype, lse_BHL float32): softmax(scale q k^T [+ causal mask]) v and its row LSE."""
    if backend == "flash_attn":
        out_BLHD, lse_BHL, _ = flash_attn_func()(q_BHLD.transpose(1, 2), k_BHMD.transpose(1, 2),
                                                  v_BHMD.transpose(1, 2), softmax_scale=scale, causal=causal,
                                                  return_attn_probs=True)
        return out_BLHD.transpose(1, 2), lse_BHL.float()
    if backend == "cudnn":
        try:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q_BHLD, k_BHMD, v_BHMD, None, True, 0.0,
                                                                     causal, False, scale=scale)
            return out[0], out[1].reshape(q_BHLD.shape[:3]).float()
        except RuntimeError as exc:
            _warn_cudnn_fallback(str(exc).splitlines()[0][:200])
    if backend not in FORWARD_BACKENDS:
        raise ValueError(f"attention backend {backend!r}; valid: {list(FORWARD_BACKENDS)}")
    out = torch.ops.aten._scaled_dot_product_flash_attention(q_BHLD, k_BHMD, v_BHMD, 0.0, causal, False,
                                                             scale=scale)
    return out[0], out[1]


@functools.cache
def _dense_aux(device: torch.device, backend: str):
    """The sequence-length and RNG arguments that aten's flash (backend "flash") or cuDNN ("cudnn") attention
    forward hands its backward for dense (not variable-length) inputs without dropout, taken from a tiny forward
    exactly as torch's own autograd does: (cum_seq_q, cum_seq_k, philox_seed, philox_offset)."""
    x = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16, device=device)
    if backend == "cudnn":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
    return out[2], out[3], out[6], out[7]


def attend_backward(dout_BHLD, q_BHLD, k_BHMD, v_BHMD, out_BHLD, lse_BHL, causal: bool, scale: float,
                    backend: str = "flash"):
    """(dq, dk, dv) of one part of the keys, given the GLOBAL out and lse of the rows (the ring-attention identity:
    torch's own context-parallel attention calls both backwards this way). backend "cudnn": cuDNN's backward (on
    an H200 at head dim 256, over the pages of exact mode's walk: 437 TFLOP/s against aten flash's 315), falling
    back to aten flash for a shape cuDNN refuses (logged once); otherwise aten flash's backward."""
    dout_BHLD, out_BHLD = dout_BHLD.contiguous(), out_BHLD.contiguous()
    if backend == "cudnn":
        cum_q, cum_k, philox_seed, philox_offset = _dense_aux(q_BHLD.device, "cudnn")
        try:
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout_BHLD, q_BHLD, k_BHMD, v_BHMD, out_BHLD, lse_BHL.float().unsqueeze(-1).contiguous(),
                philox_seed, philox_offset, None, cum_q, cum_k, q_BHLD.shape[2], k_BHMD.shape[2], 0.0, causal,
                scale=scale)
        except RuntimeError as exc:
            _warn_cudnn_fallback("backward: " + str(exc).splitlines()[0][:200])
    cum_q, cum_k, philox_seed, philox_offset = _dense_aux(q_BHLD.device, "flash")
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout_BHLD, q_BHLD, k_BHMD, v_BHMD, out_BHLD, lse_BHL.contiguous(),
        cum_q, cum_k, q_BHLD.shape[2], k_BHMD.shape[2], 0.0, causal, philox_seed, philox_offset, scale=scale,
    )
    return dq, dk, dv


def attend_pages_backward(do_KMD, q_KMD, out_KMD, lse_KM, k_pages_PKD, v_pages_PKD, scale: float, backend: str,
                          need_kp: bool = True, need_vp: bool = True):
    """-> (dq_KMD fp32, dk_pages_PKD, dv_pages_PKD or None where not needed): folded query rows' backward against
    every page through the forward kernel's own backward (`attend_backward`), chunks of BACKWARD_PAGE_CHUNK pages
    so its page-gradient buffers stay bounded. The pages' path where triton_page_tiles cannot serve the head dim."""
    P = k_pages_PKD.shape[0]
    q_1KMD, do_1KMD, out_1KMD, lse_1KM = q_KMD[None], do_KMD[None], out_KMD[None], lse_KM[None]
    dq_KMD = torch.zeros(q_KMD.shape, dtype=torch.float32, device=q_KMD.device)
    dk_pages_PKD = torch.empty_like(k_pages_PKD) if need_kp else None
    dv_pages_PKD = torch.empty_like(v_pages_PKD) if need_vp else None
    for p0 in range(0, P, BACKWARD_PAGE_CHUNK):
        p1 = min(P, p0 + BACKWARD_PAGE_CHUNK)
        dq, dk_1KND, dv_1KND = attend_backward(
            do_1KMD, q_1KMD, k_pages_PKD[p0:p1].transpose(0, 1)[None], v_pages_PKD[p0:p1].transpose(0, 1)[None],
            out_1KMD, lse_1KM, False, scale, backend)
        dq_KMD += dq[0].float()
        if need_kp:
            dk_pages_PKD[p0:p1] = dk_1KND[0].transpose(0, 1)
        if need_vp:
            dv_pages_PKD[p0:p1] = dv_1KND[0].transpose(0, 1)
        del dq, dk_1KND, dv_1KND
    return dq_KMD, dk_pages_PKD, dv_pages_PKD


# the pages' forward as a batch of page ranges when kv heads x row tiles give the GPU fewer programs than SMs
# (the forward kernels keep a row tile's whole walk over the pages in one program): on one H200, qwen36_mini at 256K
# pages, one call of 4,096 folded rows (a replay block of 512) ran at 407 TFLOP/s against 758 for 8,192 rows, in
# about the same time. Each range holds at least PAGE_SPLIT_MIN_PAGES pages; at most PAGE_SPLITS_MAX ranges.
PAGE_SPLIT_MIN_PAGES = 1 << 14
PAGE_SPLITS_MAX = 8
# the forward kernels' query rows per program, as this estimate takes them
PAGE_SPLIT_TILE_ROWS = 128


def page_splits(num_kv: int, rows: int, pages: int, device: torch.device) -> int:
    """Page ranges for the pages' forward: 1 when kv heads x row tiles fill at least half the SMs, else enough
    ranges for every SM to hold a program."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_kv * -(-rows // PAGE_SPLIT_TILE_ROWS)
    if 2 * programs > sms:
        return 1
    want = min(PAGE_SPLITS_MAX, -(-sms // programs))
    return max(1, min(want, pages // PAGE_SPLIT_MIN_PAGES))


def attend_pages(q_1KMD, k_pages_PKD, v_pages_PKD, scale: float, backend: str, splits: int | None = None):
    """-> (out_1KMD in at least fp32, lse_1KM): folded query rows against all pages, no mask. With splits > 1 (None:
    `page_splits`) the pages run as a batch of equal ranges (the rows repeated per range; the last P mod splits
    pages as one more call), merged by LSE."""
    P, K, D = k_pages_PKD.shape
    M = q_1KMD.shape[2]
    splits = page_splits(K, M, P, q_1KMD.device) if splits is None else splits
    if splits <= 1:
        out_1KMD, lse_1KM = attend(q_1KMD, k_pages_PKD.transpose(0, 1)[None], v_pages_PKD.transpose(0, 1)[None],
                                   False, scale, backend)
        return at_least_fp32(out_1KMD), lse_1KM
    span = P // splits
    k_CKND, v_CKND = (pages[: splits * span].unflatten(0, (splits, span)).transpose(1, 2)
                      for pages in (k_pages_PKD, v_pages_PKD))
    out_CKMD, lse_CKM = attend(q_1KMD.expand(splits, -1, -1, -1).contiguous(), k_CKND, v_CKND, False, scale, backend)
    outs, lses = list(at_least_fp32(out_CKMD).unbind(0)), list(lse_CKM.unbind(0))
    if splits * span < P:
        out_1KMD, lse_1KM = attend(q_1KMD, k_pages_PKD[splits * span :].transpose(0, 1)[None],
                                   v_pages_PKD[splits * span :].transpose(0, 1)[None], False, scale, backend)
        outs.append(at_least_fp32(out_1KMD[0]))
        lses.append(lse_1KM[0])
    lse_KM = torch.logsumexp(torch.stack(lses), dim=0)
    out_KMD = sum(torch.exp(lse - lse_KM)[..., None] * out for out, lse in zip(outs, lses))
    return out_KMD[None], lse_KM[None]


def _fold_pages_query(x_BRQD, K):
    """[B, R, Q, D] -> [1, K, B*G*R, D]: batch and a kv group's query heads become query rows."""
    B, R, Q, D = x_BRQD.shape
    return x_BRQD.reshape(B, R, K, Q // K, D).permute(2, 0, 3, 1, 4).reshape(1, K, B * (Q // K) * R, D)


def _fold_pages_lse(lse_BQR, K):
    B, Q, R = lse_BQR.shape
    return lse_BQR.reshape(B, K, Q // K, R).permute(1, 0, 2, 3).reshape(1, K, B * (Q // K) * R)


def _fold_pages_rows(q_BRQD, dout_BRQD, out_BRQD, lse_BQR, K):
    """The pages' backward operands as folded rows: (q_KMD, do_KMD, out_KMD, lse_KM)."""
    return (_fold_pages_query(q_BRQD, K)[0], _fold_pages_query(dout_BRQD, K)[0], _fold_pages_query(out_BRQD, K)[0],
            _fold_pages_lse(lse_BQR, K)[0])


def _unfold_pages_query(x_1KMD, B, R):
    """Inverse of _fold_pages_query, to [B, Q, R, D]."""
    _, K, M, D = x_1KMD.shape
    G = M // (B * R)
    return x_1KMD.reshape(K, B, G, R, D).permute(1, 0, 2, 3, 4).reshape(B, K * G, R, D)


class _FlashReplayAttention(_ReplayAttention):
    @staticmethod
    def forward(ctx, q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, scale, block_size):
        B, R, Q, D = q_BRQD.shape
        P, K = k_pages_PKD.shape[:2]
        S, G = k_new_BSKD.shape[1], Q // K
        backend = forward_backend()
        outs, lses = [], []
        if S > 0:
            q_BQRD = q_BRQD.transpose(1, 2)
            k_BQSD = k_new_BSKD.transpose(1, 2).repeat_interleave(G, dim=1)
            v_BQSD = v_new_BSKD.transpose(1, 2).repeat_interleave(G, dim=1)
            out_BQRD, lse_BQR = attend(q_BQRD, k_BQSD, v_BQSD, R > 1, scale, backend)
            outs.append(out_BQRD.float())
            lses.append(lse_BQR)
        if P > 0:
            out_1KMD, lse_1KM = attend_pages(_fold_pages_query(q_BRQD, K), k_pages_PKD, v_pages_PKD, scale, backend)
            outs.append(_unfold_pages_query(out_1KMD, B, R))
            lses.append(lse_1KM.reshape(K, B, G, R).permute(1, 0, 2, 3).reshape(B, Q, R))
        lse_BQR = lses[0] if len(lses) == 1 else torch.logaddexp(lses[0], lses[1])
        out_BQRD = sum(torch.exp(l - lse_BQR)[..., None] * o for o, l in zip(outs, lses))
        out_BRQD = out_BQRD.transpose(1, 2).to(q_BRQD.dtype).contiguous()
        save_for_replay_backward(ctx, (q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR),
                                 scale, block_size, flash_replay_attention_backward)
        return out_BRQD, lse_BQR


@functools.cache
def _say_lse_cotangent_takes_the_reference() -> None:
    log.warning("replay attention backward: an lse cotangent (the kernel takes none) sends this backward to the "
                "fp32 torch reference, several times slower than the flash backward (logged once)")


def flash_replay_attention_backward(saved, needs_grad, dout_BRQD, dlse_BQR, *, scale, block_size):
    """`reference.replay_attention_backward`'s contract through aten's flash backward; with an lse cotangent
    (the kernel has none) or no output cotangent, the reference's."""
    if dlse_BQR is not None or dout_BRQD is None:
        if dlse_BQR is not None:
            _say_lse_cotangent_takes_the_reference()
        return replay_attention_backward(saved, needs_grad, dout_BRQD, dlse_BQR, scale=scale, block_size=block_size)
    q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR = saved
    need_q, need_kp, need_vp, need_kn, need_vn = needs_grad
    B, R, Q, D = q_BRQD.shape
    P, K = k_pages_PKD.shape[:2]
    S, G = k_new_BSKD.shape[1], Q // K
    backend = forward_backend()
    dout_BRQD = dout_BRQD.to(q_BRQD.dtype)
    dq_BQRD = torch.zeros(B, Q, R, D, dtype=torch.float32, device=q_BRQD.device)
    dk_new_BSKD = dv_new_BSKD = dk_pages_PKD = dv_pages_PKD = None
    if S > 0:
        k_BQSD = k_new_BSKD.transpose(1, 2).repeat_interleave(G, dim=1)
        v_BQSD = v_new_BSKD.transpose(1, 2).repeat_interleave(G, dim=1)
        dq, dk_BQSD, dv_BQSD = attend_backward(dout_BRQD.transpose(1, 2), q_BRQD.transpose(1, 2), k_BQSD,
                                               v_BQSD, out_BRQD.transpose(1, 2), lse_BQR, R > 1, scale, backend)
        dq_BQRD += dq.float()
        # the expanded keys' gradients sum over the G query heads of each kv head
        if need_kn:
            dk_new_BSKD = dk_BQSD.float().reshape(B, K, G, S, D).sum(2).transpose(1, 2).to(k_new_BSKD.dtype)
        if need_vn:
            dv_new_BSKD = dv_BQSD.float().reshape(B, K, G, S, D).sum(2).transpose(1, 2).to(v_new_BSKD.dtype)
    if P > 0 and (need_q or need_kp or need_vp):
        q_KMD, do_KMD, out_KMD, lse_KM = _fold_pages_rows(q_BRQD, dout_BRQD, out_BRQD, lse_BQR, K)
        if triton_pages_supported(q_BRQD, k_pages_PKD, v_pages_PKD):
            delta_KM = (do_KMD.float() * out_KMD.float()).sum(-1)
            if need_kp or need_vp:
                from longstraw_kernels.attention.triton_page_tiles import page_backward

                dq_KMD, dk_pages_PKD, dv_pages_PKD = page_backward(q_KMD, do_KMD, lse_KM, delta_KM, k_pages_PKD,
                                                                   v_pages_PKD, scale)
                dk_pages_PKD, dv_pages_PKD = (dk_pages_PKD if need_kp else None), (dv_pages_PKD if need_vp else None)
            else:
                from longstraw_kernels.attention.triton_page_dq import page_dq

                dq_KMD = page_dq(q_KMD, do_KMD, lse_KM, delta_KM, k_pages_PKD, v_pages_PKD, scale)
        else:
            dq_KMD, dk_pages_PKD, dv_pages_PKD = attend_pages_backward(do_KMD, q_KMD, out_KMD, lse_KM, k_pages_PKD,
                                                                       v_pages_PKD, scale, backend, need_kp, need_vp)
        dq_BQRD += _unfold_pages_query(dq_KMD[None], B, R)
    dq_BRQD = dq_BQRD.transpose(1, 2).to(q_BRQD.dtype) if need_q else None
    return dq_BRQD, dk_pages_PKD, dv_pages_PKD, dk_new_BSKD, dv_new_BSKD
