"""Gated DeltaNet forward on CUDA through fla's Triton kernels, for graph-free work: the chunked kernel for
capture and scoring, the fused recurrent kernel for one decode token (`gdn_step`).

fla's gated backward refuses on Hopper below Triton 3.7.1 (fla issue 640: wrong results there), so anything
that needs a gradient stays on the torch chunked implementation. q and k come in L2-normalised in fp32 and are
cast to v's dtype for the kernel; g and beta stay fp32; states are fp32 [B, G, K, V], fla's layout.
"""

import functools

import torch

from longstraw_kernels.gdn.reference import gdn_chunked, gdn_recurrent


@functools.lru_cache(maxsize=1)
def fla_forward():
    """fla's chunk_gated_delta_rule, or None where fla (or a GPU) is missing. Imported lazily: on a CPU
    machine with triton installed, importing fla breaks transformers."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


@functools.lru_cache(maxsize=1)
def fla_recurrent():
    """fla's fused_recurrent_gated_delta_rule (forward only), or None where fla or a GPU is missing."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return fused_recurrent_gated_delta_rule


# opaque to torch.compile (the compiled decode step): inductor would re-trace the Triton kernel inside
@torch.compiler.disable
def gdn_step(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale=None):
    """gdn_recurrent's contract for a few tokens without gradient (decode: T = 1, one state per response): fla's
    fused recurrent kernel on CUDA in bf16/fp16 (one launch, state read and written once), else the torch
    recurrence. -> (o_BTGV in v's dtype, final state fp32 [B, G, K, V])."""
    kernel = fla_recurrent() if v_BTGV.is_cuda and v_BTGV.dtype in (torch.bfloat16, torch.float16) else None
    if kernel is None:
        return gdn_recurrent(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale)
    dtype = v_BTGV.dtype
    # trap: fla's recurrent signature has gk / gv between g and beta: beta goes by keyword
    o_BTGV, final_BGKV = kernel(
        q_BTHK.to(dtype), k_BTHK.to(dtype), v_BTGV, g=g_BTG.float(), beta=beta_BTG.to(dtype),
        scale=q_BTHK.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=initial_state_BGKV.float().contiguous(), output_final_state=True,
    )
    return o_BTGV, final_BGKV


def gdn_forward(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, scale=None, chunk_size=64):
    """gdn_chunked's contract; fla's kernel on CUDA when no gradient is needed and v is bf16/fp16."""
    inputs = (q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    kernel = fla_forward() if v_BTGV.is_cuda and v_BTGV.dtype in (torch.bfloat16, torch.float16) else None
    if kernel is None or needs_grad or chunk_size != 64 or v_BTGV.shape[1] == 0:
        return gdn_chunked(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale, chunk_size)
    dtype = v_BTGV.dtype
    state = None if initial_state_BGKV is None else initial_state_BGKV.float().contiguous()
    o_BTGV, final_BGKV = kernel(
        q_BTHK.to(dtype), k_BTHK.to(dtype), v_BTGV, g_BTG.float(), beta_BTG.to(dtype),
        scale=q_BTHK.shape[-1] ** -0.5 if scale is None else scale, initial_state=state, output_final_state=True,
    )
    return o_BTGV, final_BGKV
