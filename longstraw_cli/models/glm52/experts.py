"""glm52's routed experts on one device: the default `experts_fn` of a MoE layer, and the pieces of it that
expert parallelism (distributed/ep.py) reuses around its all-to-all.

The contract (a mirror of HF `GlmMoeDsaExperts.forward`):

    experts_fn(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj, down_proj) -> y_NC
    y[n] = sum_j topk_w[n, j] * down[e] @ (silu(gate) * up),  (gate, up) = chunk(gate_up[e] @ x[n], 2),
    e = topk_idx[n, j]

Order of operations follows HF, and `local_experts`' forward equals HF's bit for bit: per expert, its rows in
HF's order (top-k slot, then token) through gate_up, silu(gate) * up, down in the activations' dtype; the fp32
weight multiplies that (promoting), the product is cast back, and a token's contributions are added to zeros in
ascending expert id, one rounding per add. HF does that with one index_add_ per expert; here the contributions
are placed in [N, k] slots ordered by expert id and added slot by slot: the same additions in the same order,
without duplicate indices (so deterministic on GPU too), k adds instead of E index_add_ calls.
Simplifications: the activation is silu (GLM's `hidden_act`). On a GPU (bf16, sm90+: `grouped_mm_serves`) the
experts run as two grouped GEMMs (torch._grouped_mm), one launch each and no host synchronisation: the same
products per row, another GEMM kernel's rounding, so there HF is matched to bf16's noise rather than bit for bit.
Elsewhere (CPU, where the tests hold the bit-for-bit match; NF4 experts) each expert runs one matmul pair.

NF4 experts (`lora.quantize=nf4`: `quantize.NF4Experts`, one NF4 matrix per expert) go through the same code:
`expert_ffn` multiplies each expert that has rows through `quantize.linear` (that expert dequantised, in Triton on
CUDA; its backward dequantises again and gives gradients to the rows, never to the frozen expert), so a call
dequantises only the experts its tokens are routed to; `dense_experts` dequantises `quantize.experts_per_pass`
experts at a time. Neither ever holds the whole expert tensor in the model dtype.

Legend: N tokens, k experts per token, C hidden, I expert intermediate, X = 2I, L experts held here, G experts
of one dense pass, M (token, expert) pairs.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from longstraw_cli.quantize import dense, experts_per_pass, linear
from longstraw_kernels import kernel_choice
from longstraw_kernels.linear import kernel_module

__all__ = ["combine", "dense_experts", "expert_ffn",
           "grouped_expert_ffn", "grouped_experts", "grouped_mm_blocker", "grouped_mm_serves", "local_experts",
           "pairs_by_expert", "skinny_experts", "skinny_serves"]

log = logging.getLogger(__name__)


def grouped_mm_serves(x_MC, gate_up_L2IC, down_LCI) -> bool:
    """Whether `expert_ffn` runs as two grouped GEMMs (torch._grouped_mm: one launch for all experts, no host
    synchronisation): bf16 activations and plain bf16 weights on one CUDA device of compute capability >= 9.0,
    every matrix dimension a multiple of 8 (16-byte rows). `kernels.experts=torch` keeps the per-expert loop
    (A/B runs). Elsewhere (CPU, NF4 experts, other dtypes) the loop runs."""
    if kernel_choice("experts") == "torch":
        return False
    tensors = (x_MC, gate_up_L2IC, down_LCI)
    if not all(type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.bfloat16 and t.is_cuda for t in tensors):
        return False
    # no rows at all (an expert-parallel rank sent nothing): the loop's zero-row pass, whose gradients reach
    # every parameter as zeros, is the tested way
    if x_MC.shape[0] == 0 or len({t.device for t in tensors}) != 1:
        return False
    blocker = grouped_mm_blocker(torch.cuda.get_device_capability(x_MC.device), hasattr(torch, "_grouped_mm"))
    if blocker is not None:
        _loop_on_this_gpu(blocker)
        return False
    return all(d % 8 == 0 for d in (*gate_up_L2IC.shape[1:], *down_LCI.shape[1:]))


def grouped_mm_blocker(capability: tuple[int, int], has_grouped_mm: bool) -> str | None:
    """Why a GPU of `capability` with this torch cannot run the grouped GEMMs, or None."""
    if not has_grouped_mm:
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if capability < (9, 0):
        return f"compute capability {capability[0]}.{capability[1]} < 9.0"
    return None


@functools.cache
def _loop_on_this_gpu(reason: str) -> None:
    """Said once per reason: a GPU run whose experts cannot take the grouped GEMMs, and what that costs."""
    log.warning("glm52's routed experts run one matmul pair per expert on this GPU (%s), not as grouped GEMMs: "
                "slower where a step has many experts (glm52_mini's 256K capture on an H200: 11.4 s looped, 10.7 s "
                "grouped)", reason)


def grouped_expert_ffn(x_MC, counts_L: torch.Tensor, gate_up_L2IC, down_LCI):
    """`expert_ffn` as two grouped GEMMs over every expert's rows at once (each row's products those of its own
    expert's matrices; the rounding that of one GEMM kernel rather than a matmul per expert)."""
    offs_L = counts_L.to(device=x_MC.device).cumsum(0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x_MC, gate_up_L2IC.transpose(1, 2), offs=offs_L).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down_LCI.transpose(1, 2), offs=offs_L)


def expert_ffn(x_MC, counts_L, gate_up_L2IC, down_LCI):
    """down[e] @ (silu(gate) * up) for rows grouped by expert: counts_L[e] consecutive rows for expert e (a list
    or a tensor). Where `grouped_mm_serves`, two grouped GEMMs; else per expert, only the experts with rows read
    (NF4 ones dequantised)."""
    if grouped_mm_serves(x_MC, gate_up_L2IC, down_LCI):
        return grouped_expert_ffn(x_MC, torch.as_tensor(counts_L), gate_up_L2IC, down_LCI)
    if isinstance(counts_L, torch.Tensor):
        counts_L = counts_L.tolist()
    # unbind: the backward stacks the experts' gradients once (zeros for idle experts) instead of one
    # full-size zero tensor per indexed expert (NF4 experts: their matrices, never a gradient).
    gate_up_list, down_list = gate_up_L2IC.unbind(0), down_LCI.unbind(0)
    y_list_MC, row = [], 0
    for e, num_rows in enumerate(counts_L):
        if num_rows == 0:
            continue
        gate, up = linear(x_MC[row:row + num_rows], gate_up_list[e]).chunk(2, dim=-1)
        y_list_MC.append(linear(F.silu(gate) * up, down_list[e]))
        row += num_rows
    if not y_list_MC:
        # No rows at all: a zero-row pass keeps the parameters and x in the graph, so their gradients are zeros
        # (as the one-rank model's are) and this rank's backward reaches the collectives others wait in.
        gate, up = linear(x_MC[:0], gate_up_list[0]).chunk(2, dim=-1)
        y_list_MC.append(linear(F.silu(gate) * up, down_list[0]))
    return torch.cat(y_list_MC)


def combine(y_MC, pairs_M, topk_idx_Nk, topk_w_Nk, x_NC):
    """sum over a token's pairs of w * y, added in ascending expert id as HF's per-expert index_add_ does.

    y_MC[i] is the expert output of pair pairs_M[i] (= n * k + j, j the top-k slot); pairs absent from pairs_M
    contribute nothing."""
    N, k = topk_idx_Nk.shape
    contrib_MC = (y_MC * topk_w_Nk.reshape(-1)[pairs_M, None]).to(x_NC.dtype)
    # slot of (n, j): the rank of topk_idx[n, j] among token n's expert ids
    slot_Nk = topk_idx_Nk.argsort(dim=1, stable=True).argsort(dim=1)
    dest_M = pairs_M - pairs_M % k + slot_Nk.reshape(-1)[pairs_M]
    C = x_NC.shape[1]
    slots_NkC = contrib_MC.new_zeros(N * k, C).index_copy(0, dest_M, contrib_MC).view(N, k, C)
    y_NC = x_NC.new_zeros(x_NC.shape)
    for s in range(k):
        y_NC = y_NC + slots_NkC[:, s]
    return y_NC


def pairs_by_expert(topk_idx_Nk, first_expert, num_local, every_pair_local: bool = False):
    """(token, slot) pairs routed to experts [first_expert, first_expert + L): -> (pairs_M = n * k + j, grouped by
    expert; counts_L rows per expert). Inside an expert pairs go slot-major (j, then n), HF's row order, so the
    matmuls see the same rows in the same order and the output matches HF's bit for bit.
    every_pair_local: the caller holds every expert a token may be routed to (M = N * k), so nothing is filtered
    and the shapes are static (no nonzero(), counts by comparison): a CUDA graph may replay it."""
    N, k = topk_idx_Nk.shape
    local_kN = topk_idx_Nk.T.reshape(-1) - first_expert
    if every_pair_local:
        slot_major_M = local_kN.argsort(stable=True)
        counts_L = (local_kN[:, None] == torch.arange(num_local, device=local_kN.device)).sum(0)
        return (slot_major_M % N) * k + slot_major_M // N, counts_L
    slot_major_M = ((local_kN >= 0) & (local_kN < num_local)).nonzero().squeeze(1)
    slot_major_M = slot_major_M[local_kN[slot_major_M].argsort(stable=True)]
    counts_L = torch.bincount(local_kN[slot_major_M], minlength=num_local)
    return (slot_major_M % N) * k + slot_major_M // N, counts_L


def local_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj, down_proj, *, first_expert: int | None = None):
    """The routed experts on one device: -> y_NC in x's dtype (see the module docstring for the math).

    first_expert None (the hook's default): gate_up_proj [E, 2I, C] and down_proj [E, C, I] hold every expert, so
    every pair is local and the pairs are grouped with static shapes (`pairs_by_expert(every_pair_local=True)`): on
    a GPU with the grouped GEMMs the layer has no host synchronisation (the capture's MoE layers keep the GPU's
    queue full). An int: they hold experts [first_expert, first_expert + L) (expert parallel's partials); pairs
    routed to any other expert contribute nothing (found by nonzero(): one synchronisation).
    """
    return _routed_pairs(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj, down_proj, first_expert, expert_ffn)


def grouped_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj, down_proj) -> torch.Tensor:
    """`local_experts` with every expert on this device, as the grouped GEMMs (the caller checked
    `grouped_mm_serves`): static shapes and no host synchronisation, so a CUDA graph replays it, and only the
    chosen experts' weights are read (an expert with no rows is a group of none). The static decode step's experts
    on a GPU; `dense_experts` elsewhere."""
    return _routed_pairs(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj, down_proj, None, grouped_expert_ffn)


def _routed_pairs(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj, down_proj, first_expert: int | None, ffn):
    """The pairs grouped by expert (every pair where first_expert is None), through `ffn`, combined per token."""
    pairs_M, counts_L = pairs_by_expert(topk_idx_Nk, first_expert or 0, gate_up_proj.shape[0],
                                        every_pair_local=first_expert is None)
    y_MC = ffn(x_NC[pairs_M // topk_idx_Nk.shape[1]], counts_L, gate_up_proj, down_proj)
    return combine(y_MC, pairs_M, topk_idx_Nk, topk_w_Nk, x_NC)


def dense_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj_EXC, down_proj_ECI) -> torch.Tensor:
    """`local_experts` computed over every expert: each expert's weights are read once and the routing weights
    (fp32, zero for experts not chosen) combine the outputs. Static shapes. Plain weights in one batched pass;
    NF4 experts in passes of `experts_per_pass` experts, each pass's experts dequantised, multiplied and freed."""
    E = gate_up_proj_EXC.shape[0]
    w_NE = _routing_weights(topk_idx_Nk, topk_w_Nk, E)
    step, y_NC = experts_per_pass(gate_up_proj_EXC), None
    for e0 in range(0, E, step):
        gate_up_GXC, down_GCI = dense(gate_up_proj_EXC[e0:e0 + step]), dense(down_proj_ECI[e0:e0 + step])
        gate_GNI, up_GNI = torch.matmul(x_NC, gate_up_GXC.transpose(1, 2)).chunk(2, dim=-1)
        y_GNC = torch.matmul(F.silu(gate_GNI) * up_GNI, down_GCI.transpose(1, 2))
        part_NC = torch.einsum("gnc,ng->nc", y_GNC.to(w_NE.dtype), w_NE[:, e0:e0 + step])
        y_NC = part_NC if y_NC is None else y_NC + part_NC
    return y_NC.to(x_NC.dtype)


def _routing_weights(topk_idx_Nk, topk_w_Nk, num_experts: int) -> torch.Tensor:
    """[N, E] routing weights: topk_w at the chosen experts, zero elsewhere (topk_w's dtype)."""
    w_NE = torch.zeros(topk_idx_Nk.shape[0], num_experts, dtype=topk_w_Nk.dtype, device=topk_w_Nk.device)
    return w_NE.scatter_(1, topk_idx_Nk, topk_w_Nk)


def skinny_serves(x_NC, gate_up_proj_EXC, down_proj_ECI) -> bool:
    """Whether `skinny_experts` runs for these (kernels.decode_linear=auto, and the decode linear kernel's
    `experts_supported`: CUDA, bf16/fp16, at most 16 rows, plain contiguous expert weights; Triton importable)."""
    module = kernel_module() if x_NC.is_cuda else None
    return module is not None and module.experts_supported(x_NC, gate_up_proj_EXC, down_proj_ECI)


def skinny_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj_EXC, down_proj_ECI, *, config=None) -> torch.Tensor:
    """`dense_experts`' products and rounding with each expert's FFN in the decode linear kernel with an expert axis
    (`triton_skinny.decode_experts_triton`: two launches), where an expert no token chose reads no weight: a decode
    step of few tokens reads the chosen experts only (glm52_mini at G = 8: ~21 of 32), with static shapes and no
    host synchronisation, where the grouped GEMMs ran below the bandwidth at a row or two a group. The caller
    checked `skinny_serves` (tests call it under Triton's interpreter). config: the kernel's blocks (tests)."""
    from longstraw_kernels.linear.triton_skinny import decode_experts_triton

    E = gate_up_proj_EXC.shape[0]
    w_NE = _routing_weights(topk_idx_Nk, topk_w_Nk, E)
    active_E = torch.zeros(E, dtype=torch.int32, device=x_NC.device).index_fill_(0, topk_idx_Nk.reshape(-1), 1)
    y_ENC = decode_experts_triton(x_NC, gate_up_proj_EXC, down_proj_ECI, active_E, config)
    return torch.einsum("enc,ne->nc", y_ENC.to(w_NE.dtype), w_NE).to(x_NC.dtype)
