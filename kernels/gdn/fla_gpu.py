"""Gated DeltaNet forward on CUDA through fla's chunked Triton kernel, for graph-free work (capture, scoring).

fla's gated backward refuses on Hopper below Triton 3.7.1 (fla issue 640: wrong results there), so anything
that needs a gradient stays on the torch chunked implementation. q and k come in L2-normalised in fp32 and are
cast to v's dtype for the kernel; g and beta stay fp32; states are fp32 [B, G, K, V], fla's layout.
"""

import functools

import torch

from longstraw_kernels.gdn.reference import gdn_chunked


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
