"""The decode step's linears at a few rows (M <= 16: one row per response), with their neighbours fused, for CUDA.

At decode a linear multiplies B rows (the G responses) by a weight of N x K: it reads the weight once and does
little else, so its time is the weight's bytes over the bandwidth plus what a launch costs. cuBLAS runs these at
about half the bandwidth for qwen36_mini's per-layer weights (8-50 MB; docs/BENCHMARKS.md), and the norm before
each input linear, the silu * up after the gate/up linear and the residual add after the output linears are each a
kernel of their own around it. Here one launch does one linear with what surrounds it (reference.py, the contract):

    prologue  RMSNorm of x scaled by (1 + g): x (1 + g) goes into the product, the rows' sum of squares is
              gathered on the way (each program reads all of x: B x K, a few tens of KB), and the product is
              scaled by rsqrt(mean + eps) at the end: a row's rsqrt is a common factor of its dot products
              or GDN's gated output norm (gated_rms_norm): each K step is one head, normalised, scaled by the
              norm's weight, times silu(z), before it goes into the product
    epilogue  glu: silu(x W^T) * (x U^T), the gate's and the up's weights read for the same columns (`up_NK`)
              residual: residual + y

A program owns BLOCK_N output columns (of both weights under glu) and walks K (or one of SPLIT parts of K) in
BLOCK_K steps; the rows, padded to tl.dot's 16, are all M. Split over K (where the columns alone give too few
programs), each part writes its fp32 sums to a workspace and counts itself in with an atomic add; the tile's last
part adds the parts in order (deterministic: the same bits whichever part arrives last), applies the epilogue and
sets the count back to zero.
On sm90+ a launch is a programmatic dependent launch (PDL): the kernel lets the next linear's programs start as
soon as all of its own have (`gdc_launch_dependents`), and a program first asks L2 for the start of its weight
slab (PREFETCH elements of each of its rows: weights no kernel of the step writes), then waits for the previous
kernel to finish (`gdc_wait`) before it reads anything that kernel may write: the next weight's read overlaps this
linear's tail and the launch between them (CUTLASS's example 63, "GEMM with weight prefetch", does the same). On
an H200 (bench_decode_linear.py, qwen36_mini's 96 linears as one graph) this took 1.070 ms to 1.019; the gate/up
linear (glu) is launched plainly, as it ran slower programmatically (with it: 1.025-1.088 ms, by prefetch and
trigger), and larger prefetches were slower (512 elements: 1.088 ms with glu, 256: 1.043 without).
With an expert axis (`decode_experts_triton`, glm52's routed experts at decode: EXPERTS) the grid's third axis is
the expert: its weights, its rows (shared or its own) and its outputs; an expert that no token chose takes no step
of K, so its weights are not read and its outputs are zeros (glm52's decode takes it where it serves,
`kernels.decode_linear=torch` keeps the torch experts; on an H200 one MoE layer at 8 tokens: glm52_mini 0.063 ms
against 0.089 dense, GLM-5's 256 experts 1.07 against 1.52 as grouped GEMMs, bench_experts.py).
Rounding follows the modules (the norm's output, the product, silu's output and the sum in the activations'
dtype); the norm's output is rounded before the rsqrt is applied, not after, which moves a product by about one
rounding of the operand dtype.

Checked against reference.py: tests/kernels/test_decode_linear.py (Triton's interpreter on CPU, where tl.dot runs
in fp32) and tests/kernels/test_gpu.py (CUDA, bf16).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["EXPERTS_CONFIG", "MAX_ROWS", "PREFETCH", "decode_experts_triton", "decode_linear_triton",
           "experts_supported", "gate_supported", "launch_config", "programmatic_launch", "supported"]

# rows one program holds (a decode's responses on one rank), one MMA's 16; wider batches take the modules (cuBLAS):
# the launch configs were chosen at 8 rows, and more rows' tiles would not fit them in shared memory
MAX_ROWS = 16
_DTYPES = (torch.bfloat16, torch.float16)
# elements of each weight row a program asks of L2 before it waits for the previous kernel (a power of two, or 0)
PREFETCH = 128


@triton.jit
def _finish(acc, acc_up, sumsq, r_ptr, out_ptr, rows, cols, row_ok, col_ok, K, stride_rm, stride_om, eps,
            NORM: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr):
    """A tile's product [BLOCK_N, BLOCK_M] (fp32, over all of K) to its outputs: the norm's rsqrt, silu * up, the
    residual, rounded as the modules round."""
    dtype = out_ptr.dtype.element_ty
    if NORM:
        rstd = tl.rsqrt(sumsq / K + eps)
        acc = acc * rstd[None, :]
        acc_up = acc_up * rstd[None, :]
    y = acc.to(dtype).to(tl.float32)
    if GLU:
        up = acc_up.to(dtype).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dtype).to(tl.float32) * up
    mask = col_ok[:, None] & row_ok[None, :]
    if RESIDUAL:
        r = tl.load(r_ptr + rows[None, :].to(tl.int64) * stride_rm + cols[:, None], mask=mask, other=0.0)
        y = y.to(dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_om + cols[:, None], y.to(dtype), mask=mask)


@triton.jit
def _prefetch_l2(w_cols, k_begin, k_end, LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the first LINES lines (LINE elements each) of K from k_begin of each row of a weight tile (rows
    past the weight clamped to its last, in the caller's w_cols), for the loop to find there; nothing is loaded
    into registers."""
    ks = tl.minimum(k_begin + tl.arange(0, LINES) * LINE, k_end - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [w_cols + ks[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, u_ptr, g_ptr, z_ptr, r_ptr, out_ptr, part_ptr, count_ptr, active_ptr, M, N, K,
                   K_PART, stride_xm, stride_wn, stride_un, stride_zm, stride_rm, stride_om, stride_xe, stride_we,
                   stride_ue, stride_oe, eps,
                   NORM: tl.constexpr, GATED: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, INTERPRETED: tl.constexpr,
                   EXPERTS: tl.constexpr):
    pid = tl.program_id(0)
    part = tl.program_id(1)  # which of the SPLIT parts of K: [part K_PART, (part + 1) K_PART)
    e = tl.program_id(2).to(tl.int64)  # the expert (EXPERTS; else 0)
    if EXPERTS:  # one expert's linear a program row (axis 2): its rows, weights and outputs (SPLIT is 1)
        x_ptr += e * stride_xe
        w_ptr += e * stride_we
        u_ptr += e * stride_ue
        out_ptr += e * stride_oe
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    k_begin = part * K_PART
    k_end = tl.minimum(K, k_begin + K_PART)
    if PDL:
        # the next kernel may start once every program of this one has (it waits for this one's end before it
        # reads what this one writes); the weights are read by no kernel of the step that writes them, so their
        # first lines are asked for before the wait for the previous kernel, whose outputs (x, the residual, the
        # counts and the workspace it may have used) are touched only after it
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH_LINES > 0:  # (glu's launches are plain: its second weight is not asked for)
            last = tl.minimum(cols, N - 1)[:, None].to(tl.int64)
            _prefetch_l2(w_ptr + last * stride_wn, k_begin, k_end, PREFETCH_LINES, LINE)
        tl.extra.cuda.gdc_wait()
    if EXPERTS:
        # an expert no row chose: no step of K (its weights are not read), so its outputs are zeros
        k_end = tl.where(tl.load(active_ptr + e) != 0, k_end, k_begin)
    dtype = out_ptr.dtype.element_ty
    # transposed, [columns, rows]: the weight's tile is the product's left operand (the MMA's wide side), the few
    # rows its right one
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    u_cols = u_ptr + cols[:, None].to(tl.int64) * stride_un
    z_rows = z_ptr + rows[:, None].to(tl.int64) * stride_zm
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            sumsq += tl.sum(xf * xf, 1)
            g = tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = (xf * (1.0 + g)[None, :]).to(dtype)
        if GATED:  # one head a step (BLOCK_K is the head's size): its norm, w, silu(z), rounded as the module
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, 1) / BLOCK_K + eps)
            h = (xf * rstd[:, None]).to(dtype).to(tl.float32)
            h = (tl.load(g_ptr + tl.arange(0, BLOCK_K)).to(tl.float32)[None, :] * h).to(dtype).to(tl.float32)
            z = tl.load(z_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            x = (h * (z * tl.sigmoid(z))).to(dtype)
        w = tl.load(w_cols + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if INTERPRETED:  # the interpreter's bf16 tl.dot is wrong: fp32 operands there
            x, w = x.to(tl.float32), w.to(tl.float32)
        x_t = tl.trans(x)
        acc += tl.dot(w, x_t)
        if GLU:
            u = tl.load(u_cols + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if INTERPRETED:
                u = u.to(tl.float32)
            acc_up += tl.dot(u, x_t)
    if SPLIT == 1:
        _finish(acc, acc_up, sumsq, r_ptr, out_ptr, rows, cols, row_ok, col_ok, K, stride_rm, stride_om, eps,
                NORM, GLU, RESIDUAL)
    else:
        # each part leaves its fp32 sums in the workspace, [parts, tiles, (acc, acc_up, sumsq)]; the tile's last
        # part to arrive (its counter) adds all of them in part order (the same sum whichever arrives last), writes
        # the outputs and sets the counter back to 0 for the next launch
        TILE: tl.constexpr = BLOCK_N * BLOCK_M
        STRIDE: tl.constexpr = (2 * TILE if GLU else TILE) + BLOCK_M
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rows[None, :]
        tiles = tl.num_programs(0)
        mine = part_ptr + (part * tiles + pid).to(tl.int64) * STRIDE
        tl.store(mine + tile, acc)
        if GLU:
            tl.store(mine + TILE + tile, acc_up)
        if NORM:
            tl.store(mine + STRIDE - BLOCK_M + rows, sumsq)
        # every thread's stores issued before the (one-thread) release: CUTLASS's semaphore pattern
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for p in tl.static_range(SPLIT):
                theirs = part_ptr + (p * tiles + pid).to(tl.int64) * STRIDE
                # .cg: from L2, where the other parts' stores are, not a stale L1 line
                acc += tl.load(theirs + tile, cache_modifier=".cg")
                if GLU:
                    acc_up += tl.load(theirs + TILE + tile, cache_modifier=".cg")
                if NORM:
                    sumsq += tl.load(theirs + STRIDE - BLOCK_M + rows, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")
            _finish(acc, acc_up, sumsq, r_ptr, out_ptr, rows, cols, row_ok, col_ok, K, stride_rm, stride_om, eps,
                    NORM, GLU, RESIDUAL)


def launch_config(M: int, N: int, K: int, glu: bool) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT, PREFETCH) for an M x K by N x K product (glu: two of them).
    Chosen on an H200 (scripts/bench/bench_decode_linear.py): columns narrow enough for a program per SM or more, K
    in long steps with several in flight, as a weight read at the bandwidth needs; K split into 4 parts where the
    columns' tiles alone would leave most SMs idle (qwen36_mini's N = 2,048: 32 tiles; 128 programs with the parts,
    1.2-1.5x faster). At N of 6,144-9,216 (96-144 tiles) parts were slower in every config tried but one, unadopted
    (the attention's input linears, 0.116 -> 0.085 ms at 64 x 64 and 3 parts). Stream-K (a program per SM or two,
    each an equal run of all tiles' K steps; 8a9de25) was slower on an H100 for every kind but that one, the GDN
    input linear's 97 tiles on 132 SMs too. PREFETCH: the elements of each weight row asked of L2 before waiting for
    the previous kernel (sm90+, see the module's note)."""
    return (64, 256, 4, 3, 1, PREFETCH) if N > 3072 else (64, 128, 4, 4, 4, PREFETCH)


def supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the kernel takes this product: CUDA bf16/fp16, at most MAX_ROWS rows, rows and weights contiguous
    in K."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.is_cuda and x.dtype in _DTYPES and 0 < rows <= MAX_ROWS and x.stride(-1) == 1
            and all(w.dtype == x.dtype and w.stride(-1) == 1 for w in weights))


def gate_supported(K: int, gate_norm_V: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a gated norm over heads of V = len(gate_norm_V) features before a linear of K inputs:
    V a power of two in [16, 256] (a head is one K step) that divides K, the norm's weight in the rows' dtype."""
    V = gate_norm_V.shape[0]
    return 16 <= V <= 256 and V & (V - 1) == 0 and K % V == 0 and gate_norm_V.dtype == dtype


def decode_linear_triton(x: torch.Tensor, weight_NK: torch.Tensor, *, up_NK: torch.Tensor | None = None,
                         norm_K: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                         gate: torch.Tensor | None = None, gate_norm_V: torch.Tensor | None = None,
                         config: tuple[int, ...] | None = None) -> torch.Tensor:
    """reference.decode_linear_reference's contract (gate: its gate_MK), one launch. config: launch_config's tuple
    (benchmarks; SPLIT and PREFETCH may be left out: 1 and PREFETCH); under a gated norm its BLOCK_K is the head's
    size."""
    K, N = x.shape[-1], weight_NK.shape[0]
    # the kernel walks K with unit stride (a view may not: the decoder checked an example, not every input)
    x_MK = x.reshape(-1, K)
    x_MK = x_MK if x_MK.stride(-1) == 1 else x_MK.contiguous()
    M = x_MK.shape[0]
    config = config or launch_config(M, N, K, up_NK is not None)
    block_n, block_k, warps, stages, split, prefetch = (*config, *(1, PREFETCH)[len(config) - 4:])
    gate_MK = None
    if gate is not None or gate_norm_V is not None:
        if gate is None or gate_norm_V is None or norm_K is not None or not gate_supported(K, gate_norm_V, x.dtype):
            raise ValueError(f"the gated norm takes gate and gate_norm_V together, no norm_K, and heads of a power of "
                             f"two in [16, 256] dividing K = {K}, the norm in the rows' dtype; got gate_norm_V "
                             f"{None if gate_norm_V is None else (tuple(gate_norm_V.shape), gate_norm_V.dtype)}")
        gate_MK = gate.reshape(M, K)
        gate_MK = gate_MK if gate_MK.stride(-1) == 1 else gate_MK.contiguous()
        block_k = gate_norm_V.shape[0]
    residual_MN = None if residual is None else residual.reshape(M, N)
    if residual_MN is not None and residual_MN.stride(-1) != 1:
        residual_MN = residual_MN.contiguous()
    with contextlib.nullcontext() if torch.compiler.is_compiling() else torch.cuda.device_of(x):
        out = _linear_op(x_MK, weight_NK, up_NK, norm_K if gate_MK is None else gate_norm_V, gate_MK, residual_MN,
                         eps, block_n, block_k, warps, stages, split, prefetch)
    return out.view(*x.shape[:-1], N)


@functools.cache
def programmatic_launch(device: torch.device) -> bool:
    """Whether launches on `device` are programmatic dependent launches (module note): CUDA sm90 or later, not
    Triton's interpreter."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


# each column tile's count of the K parts done (split launches), per device: zero between launches (the last part
# of a tile sets it back), so one buffer serves every launch on the device's stream and every CUDA graph replay
_COUNTS: dict[torch.device, torch.Tensor] = {}
# buffers a larger one replaced: a captured graph may still count in them, so they are never freed
_REPLACED: list[torch.Tensor] = []


def _counts(device: torch.device, tiles: int) -> torch.Tensor:
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < tiles:
        if counts is not None:
            _REPLACED.append(counts)
        counts = _COUNTS[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counts


# an opaque torch op around the launch, so that the compiled decode step calls the kernel as it is. Not a
# `triton_op`: inductor's own launch of it ran 2.3x slower than this one on an H200 (96 calls of qwen36_mini's step:
# 2.71 ms against 1.20 ms eager; docs/BENCHMARKS.md)
@torch.library.custom_op("longstraw::decode_linear", mutates_args=())
def _linear_op(x_MK: torch.Tensor, weight_NK: torch.Tensor, up_NK: torch.Tensor | None, norm_K: torch.Tensor | None,
               gate_MK: torch.Tensor | None, residual_MN: torch.Tensor | None, eps: float, block_n: int,
               block_k: int, warps: int, stages: int, split: int, prefetch: int) -> torch.Tensor:
    """norm_K: the input norm's weight, or with gate_MK the gated norm's [V]; prefetch: launch_config's PREFETCH."""
    out = x_MK.new_empty(x_MK.shape[0], weight_NK.shape[0])
    _launch(x_MK, weight_NK, up_NK, norm_K, gate_MK, residual_MN, out, eps, block_n, block_k, warps, stages, split,
            prefetch)
    return out


def _launch(x, weight, up_w, norm_K, gate_MK, residual_MN, out, eps: float, block_n: int, block_k: int, warps: int,
            stages: int, split: int, prefetch: int, active_E: torch.Tensor | None = None) -> None:
    """One launch of the kernel into `out`. Without active_E: x [M, K], weight [N, K], out [M, N]. With it (int32
    [E], nonzero where an expert computes): weight [E, N, K], up_w likewise, x [M, K] shared by the experts or
    [E, M, K] one block of rows each, out [E, M, N]; no norm, gate, residual or parts of K."""
    experts = active_E is not None
    M, K = x.shape[-2:]
    N = weight.shape[-2]
    # an absent operand's pointer: any tensor (its loads are compiled out)
    up = weight if up_w is None else up_w
    tiles, block_m = triton.cdiv(N, block_n), max(16, triton.next_power_of_2(M))
    # K in `split` parts of whole BLOCK_K steps; fewer parts where K has fewer steps
    k_part = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    split = triton.cdiv(K, k_part)
    assert not experts or split == 1
    if split > 1:
        part_floats = (2 if up_w is not None else 1) * block_n * block_m + block_m
        parts = torch.empty(split * tiles * part_floats, dtype=torch.float32, device=x.device)
        counts = _counts(x.device, tiles)
    else:
        parts = counts = out  # not read
    gated = gate_MK is not None
    # not the gate/up linear (glu): launched programmatically it ran slower (module note); experts' weights are
    # not asked for before the wait (the experts chosen are known after it)
    pdl = programmatic_launch(x.device) and up_w is None
    line = 128 // x.element_size()  # elements in an L2 line
    lines = triton.next_power_of_2(triton.cdiv(prefetch, line)) if pdl and prefetch > 0 and not experts else 0

    def stride_e(t):
        return t.stride(0) if experts and t.dim() == 3 else 0

    _skinny_kernel[(tiles, split, active_E.shape[0] if experts else 1)](
        x, weight, up, x if norm_K is None else norm_K, gate_MK if gated else x,
        out if residual_MN is None else residual_MN, out, parts, counts, out if active_E is None else active_E, M, N,
        K, k_part, x.stride(-2), weight.stride(-2), up.stride(-2), gate_MK.stride(0) if gated else 0,
        0 if residual_MN is None else residual_MN.stride(0), out.stride(-2), stride_e(x), stride_e(weight),
        stride_e(up), stride_e(out), eps,
        NORM=norm_K is not None and not gated, GATED=gated, GLU=up_w is not None, RESIDUAL=residual_MN is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, PDL=pdl, PREFETCH_LINES=lines, LINE=line,
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", EXPERTS=experts, num_warps=warps, num_stages=stages,
        launch_pdl=pdl)


@_linear_op.register_fake
def _(x_MK, weight_NK, up_NK, norm_K, gate_MK, residual_MN, eps, block_n, block_k, warps, stages, split, prefetch):
    return x_MK.new_empty(x_MK.shape[0], weight_NK.shape[0])


# the routed experts of a decode step (a few tokens, every expert's weights on this device): the kernel with an
# expert axis, each expert no token chose skipped without reading its weights
EXPERTS_CONFIG = (64, 128, 4, 4)


def experts_supported(x: torch.Tensor, gate_up_EXC: torch.Tensor, down_ECI: torch.Tensor) -> bool:
    """Whether `decode_experts_triton` takes these: `supported`'s rows and dtypes, plain contiguous expert weights."""
    return (supported(x, gate_up_EXC, down_ECI) and type(gate_up_EXC) in (torch.Tensor, torch.nn.Parameter)
            and type(down_ECI) in (torch.Tensor, torch.nn.Parameter)
            and gate_up_EXC.is_contiguous() and down_ECI.is_contiguous())


def decode_experts_triton(x_MC: torch.Tensor, gate_up_EXC: torch.Tensor, down_ECI: torch.Tensor,
                          active_E: torch.Tensor, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Every expert's FFN over all M rows -> y [E, M, C] in x's dtype: silu(x G_e^T) * (x U_e^T) in one launch (G_e,
    U_e: the halves of gate_up_EXC[e], X = 2I), then that times D_e^T (down_ECI[e]) in a second, rounded as
    `dense_experts` rounds; an expert whose active_E (int32 [E]) is 0 reads no weight and gives zeros. config:
    (BLOCK_N, BLOCK_K, warps, stages), EXPERTS_CONFIG by default."""
    with contextlib.nullcontext() if torch.compiler.is_compiling() else torch.cuda.device_of(x_MC):
        return _experts_op(x_MC.contiguous(), gate_up_EXC, down_ECI, active_E, *(config or EXPERTS_CONFIG))


@torch.library.custom_op("longstraw::decode_experts", mutates_args=())
def _experts_op(x_MC: torch.Tensor, gate_up_EXC: torch.Tensor, down_ECI: torch.Tensor, active_E: torch.Tensor,
                block_n: int, block_k: int, warps: int, stages: int) -> torch.Tensor:
    (M, C), (E, I) = x_MC.shape, (gate_up_EXC.shape[0], down_ECI.shape[2])
    h_EMI = x_MC.new_empty(E, M, I)
    _launch(x_MC, gate_up_EXC[:, :I], gate_up_EXC[:, I:], None, None, None, h_EMI, 0.0, block_n, block_k, warps,
            stages, 1, 0, active_E)
    y_EMC = x_MC.new_empty(E, M, C)
    _launch(h_EMI, down_ECI, None, None, None, None, y_EMC, 0.0, block_n, block_k, warps, stages, 1, 0, active_E)
    return y_EMC


@_experts_op.register_fake
def _(x_MC, gate_up_EXC, down_ECI, active_E, block_n, block_k, warps, stages):
    return x_MC.new_empty(gate_up_EXC.shape[0], x_MC.shape[0], x_MC.shape[1])
