"""Sparse absorbed-MLA attention in Triton: the forward and the backward of `reference.sparse_mla_attention`.

One program per (query row b, t; block of BLOCK_H heads). The heads of a row share its K selected pages, so a
program gathers each block of BLOCK_K page rows once (latent [BLOCK_K, L], rope [BLOCK_K, R]; -1 entries and the
K tail masked, never read) and uses it for all its heads:
    forward  s = scale (q_l kv^T + q_r kr^T), online softmax (running max and sum in fp32), acc += p kv
    dq       p = exp(s - lse), dp = dO kv^T, ds = p (dp - delta) scale, dq_l += ds kv, dq_r += ds kr
    pages    dlatent[idx] += ds^T q_l + p^T dO, drope[idx] += ds^T q_r  (when they need a gradient)
with delta = rowsum(dO * O) - dlse formed in the backward kernel from the dO and O tiles it loads anyway (no
[B, T, H, L] fp32 temporary). The pages' gradients (exact mode's prompt pages, a blockwise replay's earlier
response keys) are summed over the program's heads and added atomically into fp32 [P, L] / [P, R] buffers, one
add per selected entry and head block; a response-only replay asks for none and runs the dq kernel alone.

Precision: bf16/fp16 inputs go to tl.dot as they are, with fp32 accumulation; p and ds are cast to the page dtype
for their dots, as flash attention does. fp32 inputs use input_precision="ieee" (no TF32). Softmax statistics,
lse and the dq accumulator are fp32; out and dq are stored in q's dtype, lse in fp32 (the reference's compute
dtype for these inputs). A row with no entry gets out 0, lse -inf and dq 0, as in the reference.

Padding: tl.dot needs every dim >= 16, so the head block is at least 16 (H = 4 runs 16 rows, 12 masked) and L,
R are padded to powers of two >= 16 with masked loads and stores. Only long-standing Triton APIs are used
(pointer loads with masks, tl.dot, tl.trans, exp2): no TMA or tensor descriptors.

Shape legend:
    B batch   T queries per sequence   H query heads   K selected entries per query   P pages
    L latent dim   R rope dim   A = L + R   N = B * T query rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["TileConfig", "default_config", "forward_splits", "unsplit_forward_config", "sparse_mla_forward",
           "sparse_mla_dq", "sparse_mla_backward", "TritonSparseMLA"]

LOG2E = 1.4426950408889634
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TileConfig:
    block_h: int  # heads per program (>= 16: tl.dot's minimum)
    block_k: int  # selected pages per loop step (>= 16)
    num_warps: int
    num_stages: int


def default_config(H: int, K: int, dtype: torch.dtype) -> TileConfig:
    """Untuned defaults (scripts/bench/bench_mla.py --sweep times others). 32 heads x L = 512 fp32 accumulator
    is 64 registers a thread at 8 warps; 64 heads would double that next to the q tile and spill. fp32 pages
    take one stage: two [32, 512] fp32 page buffers next to the q tile would crowd shared memory."""
    block_k = min(32, max(16, triton.next_power_of_2(K)))
    num_stages = 1 if dtype == torch.float32 else 2
    if H <= 16:
        return TileConfig(16, block_k, 4, num_stages)
    return TileConfig(32, block_k, 8, num_stages)


def unsplit_forward_config(H: int, K: int, dtype: torch.dtype) -> TileConfig:
    """The unsplit forward's tiles (the capture's and replay's rows): at 16 heads or fewer in bf16 / fp16, 64 pages
    a step at 8 warps. glm52_mini's capture at 256K on one H100 (2026-12-07, its 768 forward calls timed by CUDA
    events, four configs alternated, two rounds): 1.954 s of forward against 2.348 for `default_config` (16, 32, 4,
    2); (16, 64, 4, 2) 2.544, (16, 32, 4, 3) 2.301. Elsewhere `default_config`."""
    if H > 16 or dtype == torch.float32:
        return default_config(H, K, dtype)
    return TileConfig(16, min(64, max(16, triton.next_power_of_2(K))), 8, 2)


@triton.jit
def _fwd_kernel(q_ptr, lat_ptr, rope_ptr, idx_ptr, out_ptr, lse_ptr, stride_lat, stride_rope,
                H, K, num_head_blocks, qk_scale_log2, keys_per_split, split_stride_out, split_stride_lse,
                new_lat_ptr, new_rope_ptr, stride_new_lat, stride_new_rope, num_pages, slots, rows_per_seq,
                L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                TWO_SOURCES: tl.constexpr):
    # head blocks of one row are neighbours in launch order, so a row's pages are read from L2 after the first.
    # Split over the keys (axis 1, `sparse_mla_forward`'s num_splits > 1): this program reads the row's entries
    # [split * keys_per_split, +keys_per_split) and writes that part's normalised out and lse (fp32) at
    # split * split_stride_*; `_combine_kernel` merges the parts. Unsplit, the range is all K and the strides 0.
    # TWO_SOURCES (the decode: `sparse_mla_forward`'s `new`): an entry below num_pages is a page row, one in
    # [num_pages, num_pages + slots) the slot (entry - num_pages) of the row's sequence (row // rows_per_seq) in the
    # new keys' rows [sequences x slots]; any other entry is skipped
    pid, split = tl.program_id(0), tl.program_id(1)
    row = (pid // num_head_blocks).to(tl.int64)
    offs_h = (pid % num_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    mask_h, mask_l, mask_r = offs_h < H, offs_l < L, offs_r < R

    q_rows = q_ptr + row * H * (L + R) + offs_h[:, None] * (L + R)
    q_l = tl.load(q_rows + offs_l[None, :], mask=mask_h[:, None] & mask_l[None, :], other=0.0)  # [BLOCK_H, L_PAD]
    q_r = tl.load(q_rows + L + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, in log2 units
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], tl.float32)
    k_start = split * keys_per_split
    k_end = tl.minimum(k_start + keys_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + row * K + offs_k, mask=offs_k < k_end, other=-1).to(tl.int64)
        if TWO_SOURCES:
            # an entry is read from one source: the other load is masked off (0; a masked lane's address is never
            # read), and adding 0 is exact. No select on the entries here: Triton 3.6 on an H200 failed to compile
            # one (TritonGPURemoveLayoutConversions: a select whose condition and result took different layouts)
            in_pages = (idx >= 0) & (idx < num_pages)
            own = (idx >= num_pages) & (idx < num_pages + slots)
            new_row = (row // rows_per_seq) * slots + idx - num_pages
            kv = (tl.load(lat_ptr + idx[:, None] * stride_lat + offs_l[None, :],
                          mask=in_pages[:, None] & mask_l[None, :], other=0.0)
                  + tl.load(new_lat_ptr + new_row[:, None] * stride_new_lat + offs_l[None, :],
                            mask=own[:, None] & mask_l[None, :], other=0.0))
            kr = (tl.load(rope_ptr + idx[:, None] * stride_rope + offs_r[None, :],
                          mask=in_pages[:, None] & mask_r[None, :], other=0.0)
                  + tl.load(new_rope_ptr + new_row[:, None] * stride_new_rope + offs_r[None, :],
                            mask=own[:, None] & mask_r[None, :], other=0.0))
            valid = in_pages | own
        else:
            valid = idx >= 0
            page = tl.where(valid, idx, 0)
            kv = tl.load(lat_ptr + page[:, None] * stride_lat + offs_l[None, :],
                         mask=valid[:, None] & mask_l[None, :], other=0.0)  # [BLOCK_K, L_PAD]
            kr = tl.load(rope_ptr + page[:, None] * stride_rope + offs_r[None, :],
                         mask=valid[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_K, R_PAD]
        s = tl.dot(q_l, tl.trans(kv), input_precision=PRECISION)
        s += tl.dot(q_r, tl.trans(kr), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_K]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # while a row has seen no entry its max is -inf; subtracting a finite stand-in keeps exp2 at 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
        m_i = m_new

    has_entry = l_i > 0
    l_safe = tl.where(has_entry, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_entry, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    out_rows = out_ptr + split * split_stride_out + row * H * L + offs_h[:, None] * L
    tl.store(out_rows + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_l[None, :])
    tl.store(lse_ptr + split * split_stride_lse + row * H + offs_h, lse, mask=mask_h)


@triton.jit
def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits, split_stride_out, split_stride_lse,
                    L: tl.constexpr, L_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    # one program per (row, head): lse = logsumexp of the parts' lse, out = sum of exp(lse_s - lse) out_s; a part
    # with no entry has lse -inf and weight 0; a row with no entry in any part gets out 0 and lse -inf
    rh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_l = tl.arange(0, L_PAD)
    lse_s = tl.load(part_lse_ptr + offs_s * split_stride_lse + rh, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse_s - m_safe), 0)
    has_entry = total > 0
    total_safe = tl.where(has_entry, total, 1.0)
    acc = tl.zeros([L_PAD], tl.float32)
    for s in range(0, num_splits):
        w = tl.exp(tl.load(part_lse_ptr + s * split_stride_lse + rh) - m_safe) / total_safe
        acc += w * tl.load(part_out_ptr + s * split_stride_out + rh * L + offs_l, mask=offs_l < L, other=0.0)
    tl.store(out_ptr + rh * L + offs_l, acc.to(out_ptr.dtype.element_ty), mask=offs_l < L)
    tl.store(lse_ptr + rh, tl.where(has_entry, m_safe + tl.log(total_safe), float("-inf")))


@triton.jit
def _dq_kernel(q_ptr, lat_ptr, rope_ptr, idx_ptr, out_ptr, dout_ptr, lse_ptr, dlse_ptr, dq_ptr, dlat_ptr, drope_ptr,
               stride_lat, stride_rope, H, K, num_head_blocks, scale, qk_scale_log2,
               L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
               NEED_LAT: tl.constexpr = False, NEED_ROPE: tl.constexpr = False):
    pid = tl.program_id(0)
    row = (pid // num_head_blocks).to(tl.int64)
    offs_h = (pid % num_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    mask_h, mask_l, mask_r = offs_h < H, offs_l < L, offs_r < R
    mask_hl = mask_h[:, None] & mask_l[None, :]
    mask_hr = mask_h[:, None] & mask_r[None, :]

    q_rows = q_ptr + row * H * (L + R) + offs_h[:, None] * (L + R)
    q_l = tl.load(q_rows + offs_l[None, :], mask=mask_hl, other=0.0)
    q_r = tl.load(q_rows + L + offs_r[None, :], mask=mask_hr, other=0.0)
    o_offs = row * H * L + offs_h[:, None] * L + offs_l[None, :]
    do = tl.load(dout_ptr + o_offs, mask=mask_hl, other=0.0)  # [BLOCK_H, L_PAD]
    o = tl.load(out_ptr + o_offs, mask=mask_hl, other=0.0)
    dlse = tl.load(dlse_ptr + row * H + offs_h, mask=mask_h, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1) - dlse
    lse = tl.load(lse_ptr + row * H + offs_h, mask=mask_h, other=0.0)
    # a row with no entry has lse -inf and all its scores -inf: a finite stand-in gives p = 0, not NaN
    lse_log2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)

    dq_l = tl.zeros([BLOCK_H, L_PAD], tl.float32)
    dq_r = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + row * K + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
        valid = idx >= 0
        page = tl.where(valid, idx, 0)
        kv = tl.load(lat_ptr + page[:, None] * stride_lat + offs_l[None, :],
                     mask=valid[:, None] & mask_l[None, :], other=0.0)
        kr = tl.load(rope_ptr + page[:, None] * stride_rope + offs_r[None, :],
                     mask=valid[:, None] & mask_r[None, :], other=0.0)
        s = tl.dot(q_l, tl.trans(kv), input_precision=PRECISION)
        s += tl.dot(q_r, tl.trans(kr), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        p = tl.exp2(s - lse_log2[:, None])  # [BLOCK_H, BLOCK_K], exact for the row's global lse
        dp = tl.dot(do.to(kv.dtype), tl.trans(kv), input_precision=PRECISION)
        ds = (p * (dp - delta[:, None])).to(kv.dtype)  # scale applied once at the end
        dq_l += tl.dot(ds, kv, input_precision=PRECISION)
        dq_r += tl.dot(ds, kr, input_precision=PRECISION)
        # the selected pages' gradients, summed over this program's heads, added into fp32 rows [P, L] / [P, R]
        # (a page selected by several rows or head blocks gets each one's share); masked heads and entries add 0
        if NEED_LAT:
            # a latent row is a key (through ds) and a value (through p)
            dkv = (tl.dot(tl.trans(ds), q_l, input_precision=PRECISION) * scale
                   + tl.dot(tl.trans(p.to(kv.dtype)), do.to(kv.dtype), input_precision=PRECISION))
            tl.atomic_add(dlat_ptr + page[:, None] * L + offs_l[None, :], dkv, mask=valid[:, None] & mask_l[None, :])
        if NEED_ROPE:
            dkr = tl.dot(tl.trans(ds), q_r, input_precision=PRECISION) * scale
            tl.atomic_add(drope_ptr + page[:, None] * R + offs_r[None, :], dkr, mask=valid[:, None] & mask_r[None, :])

    dq_rows = dq_ptr + row * H * (L + R) + offs_h[:, None] * (L + R)
    tl.store(dq_rows + offs_l[None, :], (dq_l * scale).to(dq_ptr.dtype.element_ty), mask=mask_hl)
    tl.store(dq_rows + L + offs_r[None, :], (dq_r * scale).to(dq_ptr.dtype.element_ty), mask=mask_hr)


def supported(q_BTHA, latent_PL, rope_PR, idx_BTK) -> bool:
    """Inputs the kernels take: one dtype among DTYPES, pages with unit element stride (any row stride), at least
    one query row and one entry. Device placement is the dispatcher's concern (the interpreter runs these on CPU
    for tests)."""
    return (q_BTHA.dtype in DTYPES and latent_PL.dtype == q_BTHA.dtype and rope_PR.dtype == q_BTHA.dtype
            and latent_PL.stride(-1) == 1 and rope_PR.stride(-1) == 1 and idx_BTK.numel() > 0)


def _launch_args(q_BTHA, latent_PL, rope_PR, idx_BTK, config):
    B, T, H, _ = q_BTHA.shape
    L, R, K = latent_PL.shape[-1], rope_PR.shape[-1], idx_BTK.shape[-1]
    config = config or default_config(H, K, q_BTHA.dtype)
    num_head_blocks = triton.cdiv(H, config.block_h)
    meta = dict(L=L, R=R, L_PAD=max(16, triton.next_power_of_2(L)), R_PAD=max(16, triton.next_power_of_2(R)),
                BLOCK_H=config.block_h, BLOCK_K=config.block_k,
                PRECISION="ieee" if q_BTHA.dtype == torch.float32 else "tf32",
                num_warps=config.num_warps, num_stages=config.num_stages)
    return (B * T * num_head_blocks,), num_head_blocks, meta


def forward_splits(programs: int, K: int, block_k: int, device: torch.device) -> int:
    """How many parts to split each row's K entries into: 1 where the unsplit grid (`programs`, one per row and head
    block) already fills the GPU (capture, replay); at decode's few rows, about one program per SM, each part at
    least 4 key blocks (so the parts' fp32 partials, written and read once more, stay small next to the gathers).
    Glm52's decode at G = 8 (8 rows x 1 head block, K = 2,048, H200): 16 parts of 128 entries."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs * 2 > sms:
        return 1
    keys_per_split = max(4 * block_k, triton.cdiv(triton.cdiv(K, triton.cdiv(sms, programs)), block_k) * block_k)
    return triton.cdiv(K, keys_per_split)


def sparse_mla_forward(q_BTHA, latent_PL, rope_PR, idx_BTK, scale: float, config: TileConfig | None = None,
                       num_splits: int | None = None, new=None):
    """-> (out_BTHL in q's dtype, lse_BTH float32); `reference.sparse_mla_attention`'s forward, no autograd.
    num_splits (None: `forward_splits`) > 1 splits each row's entries into that many parts, one program each, merged
    by their lse (`_combine_kernel`; fp32 parts, out rounded once): the decode's few rows then fill the GPU.
    new = (new_latent_NL, new_rope_NR, slots): a second key source, `reference.sparse_mla_two_sources`' contract
    (the P pages, then each sequence's `slots` new keys, rows b * slots + s of new_*), in the same launch."""
    assert supported(q_BTHA, latent_PL, rope_PR, idx_BTK)
    B, T, H, _ = q_BTHA.shape
    L, K = latent_PL.shape[-1], idx_BTK.shape[-1]
    q_BTHA, idx_BTK = q_BTHA.contiguous(), idx_BTK.contiguous()
    if new is None:
        sources = (latent_PL, rope_PR, 0, 0, latent_PL.shape[0], 0, T)
    else:
        new_latent_NL, new_rope_NR, slots = new
        assert supported(q_BTHA, new_latent_NL, new_rope_NR, idx_BTK) and new_latent_NL.shape[0] == B * slots
        sources = (new_latent_NL, new_rope_NR, new_latent_NL.stride(0), new_rope_NR.stride(0), latent_PL.shape[0],
                   slots, T)
    out_BTHL = q_BTHA.new_empty(B, T, H, L)
    lse_BTH = q_BTHA.new_empty(B, T, H, dtype=torch.float32)
    grid, num_head_blocks, meta = _launch_args(q_BTHA, latent_PL, rope_PR, idx_BTK, config)
    if num_splits is None:
        num_splits = forward_splits(grid[0], K, meta["BLOCK_K"], q_BTHA.device)
    if config is None and num_splits == 1:
        config = unsplit_forward_config(H, K, q_BTHA.dtype)
        grid, num_head_blocks, meta = _launch_args(q_BTHA, latent_PL, rope_PR, idx_BTK, config)
    keys_per_split = triton.cdiv(triton.cdiv(K, num_splits), meta["BLOCK_K"]) * meta["BLOCK_K"]
    num_splits = triton.cdiv(K, keys_per_split)
    # Triton launches on the current device; q's may be another (a no-op for CPU tensors in the interpreter)
    with torch.cuda.device_of(q_BTHA):
        if num_splits == 1:
            _fwd_kernel[grid + (1,)](q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH, latent_PL.stride(0),
                                     rope_PR.stride(0), H, K, num_head_blocks, scale * LOG2E, K, 0, 0, *sources,
                                     TWO_SOURCES=new is not None, **meta)
            return out_BTHL, lse_BTH
        part_out_SBTHL = q_BTHA.new_empty(num_splits, B, T, H, L, dtype=torch.float32)
        part_lse_SBTH = q_BTHA.new_empty(num_splits, B, T, H, dtype=torch.float32)
        _fwd_kernel[grid + (num_splits,)](q_BTHA, latent_PL, rope_PR, idx_BTK, part_out_SBTHL, part_lse_SBTH,
                                          latent_PL.stride(0), rope_PR.stride(0), H, K, num_head_blocks,
                                          scale * LOG2E, keys_per_split, part_out_SBTHL.stride(0),
                                          part_lse_SBTH.stride(0), *sources, TWO_SOURCES=new is not None, **meta)
        _combine_kernel[(B * T * H,)](part_out_SBTHL, part_lse_SBTH, out_BTHL, lse_BTH, num_splits,
                                      part_out_SBTHL.stride(0), part_lse_SBTH.stride(0), L=L, L_PAD=meta["L_PAD"],
                                      SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), num_warps=4)
    return out_BTHL, lse_BTH


def sparse_mla_dq(q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH, dout_BTHL, dlse_BTH, scale: float,
                  config: TileConfig | None = None):
    """-> dq_BTHA in q's dtype, given the forward's out and lse and the cotangents (either may be None: zero)."""
    return sparse_mla_backward(q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH, dout_BTHL, dlse_BTH, scale,
                               (True, False, False), config)[0]


def sparse_mla_backward(q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH, dout_BTHL, dlse_BTH, scale: float,
                        needs_grad, config: TileConfig | None = None):
    """-> (dq_BTHA, dlatent_PL, drope_PR), None where needs_grad (three bools) says no: one kernel, dq in q's dtype
    and the pages' gradients accumulated in fp32 (atomic adds: their order, and so their last bits, vary between
    runs on a GPU) and returned in the pages' dtype. dq is computed whatever needs_grad[0] says (it costs the
    products the page gradients need anyway)."""
    assert supported(q_BTHA, latent_PL, rope_PR, idx_BTK)
    need_q, need_lat, need_rope = needs_grad
    q_BTHA, idx_BTK = q_BTHA.contiguous(), idx_BTK.contiguous()
    out_BTHL, lse_BTH = out_BTHL.contiguous(), lse_BTH.float().contiguous()
    dout_BTHL = torch.zeros_like(out_BTHL) if dout_BTHL is None else dout_BTHL.to(out_BTHL.dtype).contiguous()
    dlse_BTH = torch.zeros_like(lse_BTH) if dlse_BTH is None else dlse_BTH.float().contiguous()
    dq_BTHA = torch.empty_like(q_BTHA)
    dlat_PL = torch.zeros(latent_PL.shape, dtype=torch.float32, device=q_BTHA.device) if need_lat else None
    drope_PR = torch.zeros(rope_PR.shape, dtype=torch.float32, device=q_BTHA.device) if need_rope else None
    grid, num_head_blocks, meta = _launch_args(q_BTHA, latent_PL, rope_PR, idx_BTK, config)
    with torch.cuda.device_of(q_BTHA):
        _dq_kernel[grid](q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, dout_BTHL, lse_BTH, dlse_BTH, dq_BTHA,
                         dq_BTHA if dlat_PL is None else dlat_PL, dq_BTHA if drope_PR is None else drope_PR,
                         latent_PL.stride(0), rope_PR.stride(0), q_BTHA.shape[2], idx_BTK.shape[-1],
                         num_head_blocks, scale, scale * LOG2E, NEED_LAT=need_lat, NEED_ROPE=need_rope, **meta)
    return (dq_BTHA if need_q else None, None if dlat_PL is None else dlat_PL.to(latent_PL.dtype),
            None if drope_PR is None else drope_PR.to(rope_PR.dtype))


class TritonSparseMLA(torch.autograd.Function):
    """`reference._SparseMLA`'s contract and saved tensors (q, pages by reference, idx, out, lse); the Triton
    forward and backward (dq, and the pages' gradients where they need one)."""

    @staticmethod
    def forward(ctx, q_BTHA, latent_PL, rope_PR, idx_BTK, scale):
        out_BTHL, lse_BTH = sparse_mla_forward(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)
        ctx.save_for_backward(q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return out_BTHL, lse_BTH

    @staticmethod
    def backward(ctx, dout_BTHL, dlse_BTH):
        q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH = ctx.saved_tensors
        needs_grad = ctx.needs_input_grad[:3]
        if not any(needs_grad):
            return None, None, None, None, None
        grads = sparse_mla_backward(q_BTHA, latent_PL, rope_PR, idx_BTK, out_BTHL, lse_BTH, dout_BTHL, dlse_BTH,
                                    ctx.scale, needs_grad)
        return (*grads, None, None)
