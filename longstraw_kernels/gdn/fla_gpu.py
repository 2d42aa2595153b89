"""Gated DeltaNet on CUDA: fla's Triton kernels for graph-free work (the chunked kernel for capture and scoring,
the fused recurrent kernel for one decode token, `gdn_step`), our own Triton chunked op (`triton_chunk.py`)
where a gradient is needed.

fla's gated backward refuses on Hopper below Triton 3.7.1 (fla issue 640: wrong results there), so fla serves
forwards only. For fla, q and k come in L2-normalised in fp32 and are cast to v's dtype for the kernel; g and
beta stay fp32; states are fp32 [B, G, K, V], fla's layout.

LONGSTRAW_GDN_KERNEL = auto (default) | torch: torch takes the torch reference `gdn_chunked` wherever a gradient
is needed (A/B benchmarks, or a fallback should our kernel misbehave); graph-free work keeps fla either way.
"""

import functools

import torch

from longstraw_kernels import kernel_choice, optional_module
from longstraw_kernels.gdn.reference import gdn_chunked, gdn_recurrent


@functools.lru_cache(maxsize=1)
def fla_gdn():
    """fla's gated delta rule ops module, or None where fla (or a GPU) is missing. Imported lazily: on a CPU machine
    with triton installed, importing fla breaks transformers. Its autotuners get the choices shipped for this GPU
    (autotuned.py: a first launch does not time every config)."""
    if not torch.cuda.is_available():
        return None
    try:
        import fla.ops.gated_delta_rule as ops
    except ImportError:
        return None
    from longstraw_kernels.autotuned import seed_shipped

    seed_shipped(torch.cuda.get_device_name(), "fla.")
    return ops


def fla_forward():
    """fla's chunk_gated_delta_rule, or None where fla (or a GPU) is missing."""
    ops = fla_gdn()
    return None if ops is None else ops.chunk_gated_delta_rule


def fla_recurrent():
    """fla's fused_recurrent_gated_delta_rule (forward only), or None where fla or a GPU is missing."""
    ops = fla_gdn()
    return None if ops is None else ops.fused_recurrent_gated_delta_rule


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


def triton_chunk():
    """longstraw_kernels.gdn.triton_chunk, or None where Triton does not import."""
    return optional_module("longstraw_kernels.gdn.triton_chunk")


def use_triton(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, chunk_size=64) -> bool:
    """Whether a gradient-needing call takes `triton_chunk`: CUDA, auto, Triton imports, inputs it supports."""
    if kernel_choice("LONGSTRAW_GDN_KERNEL") == "torch" or not v_BTGV.is_cuda:
        return False
    module = triton_chunk()
    return module is not None and module.supported(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV,
                                                   chunk_size)


def fla_chunk(kernel, q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, scale=None):
    """fla's chunked forward `kernel` (graph-free) under gdn_chunked's contract: q and k cast to v's dtype, g fp32,
    beta v's dtype, the state fp32. -> (o_BTGV in v's dtype, final state fp32 [B, G, K, V])."""
    dtype = v_BTGV.dtype
    state = None if initial_state_BGKV is None else initial_state_BGKV.float().contiguous()
    return kernel(
        q_BTHK.to(dtype), k_BTHK.to(dtype), v_BTGV, g_BTG.float(), beta_BTG.to(dtype),
        scale=q_BTHK.shape[-1] ** -0.5 if scale is None else scale, initial_state=state, output_final_state=True,
    )


def gdn_forward(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, scale=None, chunk_size=64):
    """gdn_chunked's contract. On CUDA: our Triton op when a gradient is needed (see `use_triton`), fla's forward
    when none is and v is bf16/fp16; gdn_chunked everywhere else (CPU, fp64, T = 0). Where both serve (a gradient
    is needed, v bf16/fp16, fla installed) the Triton op takes its forward values from fla's kernel, as graph-free
    work computes them, and only its backward runs our own (fp32) scan: exact mode's walk then recomputes each
    block as the capture computed it, and neither the walk nor a replay pays our slower fp32 forward."""
    inputs = (q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    kernel = fla_forward() if v_BTGV.is_cuda and v_BTGV.dtype in (torch.bfloat16, torch.float16) else None
    fla_serves = kernel is not None and chunk_size == 64 and v_BTGV.shape[1] > 0
    if needs_grad and use_triton(*inputs, chunk_size):
        forward = functools.partial(fla_chunk, kernel) if fla_serves else None
        return triton_chunk().gdn_chunked_triton(*inputs, scale, chunk_size, forward=forward)
    if not fla_serves or needs_grad:
        return gdn_chunked(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale, chunk_size)
    return fla_chunk(kernel, *inputs, scale)
