"""Gated DeltaNet on CUDA: fla's chunked Triton kernel for graph-free work over many tokens (capture, scoring), our
own Triton chunked op (`triton_chunk.py`) where a gradient is needed, and the decode step's two launches a layer
(`triton_step.py`: `conv_step`, the conv and its window; `gdn_decode`, norms, gates and the recurrence; each state
advanced in place).

fla's gated backward refuses on Hopper below Triton 3.7.1 (fla issue 640: wrong results there), so fla serves
forwards only. For fla, q and k come in L2-normalised in fp32 and are cast to v's dtype for the kernel; g and
beta stay fp32; states are fp32 [B, G, K, V], fla's layout.

`kernels.gdn` = auto (default) | torch: torch takes the torch references wherever our own kernels would run
(`gdn_chunked` where a gradient is needed, `gdn_decode_reference` for the decode step: A/B benchmarks, or a fallback
should our kernels misbehave); graph-free work over many tokens keeps fla either way.
"""

import functools
import logging

import torch

from longstraw_kernels import kernel_choice, needs_grad, optional_module, say_once
from longstraw_kernels.gdn.reference import (
    causal_conv_silu,
    conv_step_reference,
    conv_window_after,
    gdn_chunked,
    gdn_decode_reference,
)

log = logging.getLogger(__name__)


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

    seed_shipped(torch.cuda.get_device_name(), "fla.", torch.cuda.get_device_capability())
    return ops


def fla_forward():
    """fla's chunk_gated_delta_rule, or None where fla (or a GPU) is missing."""
    ops = fla_gdn()
    return None if ops is None else ops.chunk_gated_delta_rule


# opaque to torch.compile (the compiled decode step): inductor would re-trace the Triton kernel inside
@torch.compiler.disable
def gdn_decode(q_BTHK, k_BTHK, v_BTGV, a_BTG, b_BTG, a_log_G, dt_bias_G, state_BGKV, scale=None):
    """`gdn_decode_reference`'s contract (raw q, k, a, b; state_BGKV advanced in place; -> o_BTGV): one Triton launch
    a layer on CUDA for one token (`triton_step.py`), the torch reference elsewhere or under kernels.gdn=torch."""
    module = _step_module(v_BTGV)
    if module is not None:
        if module.supported(q_BTHK, v_BTGV, state_BGKV):
            return module.gdn_decode_triton(q_BTHK, k_BTHK, v_BTGV, a_BTG, b_BTG, a_log_G, dt_bias_G, state_BGKV,
                                            scale)
        _say_decode_takes_the_reference("recurrence", f"q {tuple(q_BTHK.shape)} {q_BTHK.dtype}, state "
                                        f"{state_BGKV.dtype}{'' if state_BGKV.is_contiguous() else ' strided'}")
    return gdn_decode_reference(q_BTHK, k_BTHK, v_BTGV, a_BTG, b_BTG, a_log_G, dt_bias_G, state_BGKV, scale)


# opaque to torch.compile, as gdn_decode
@torch.compiler.disable
def conv_step(mixed_BTX, window_BXW, weight_X1K):
    """`conv_step_reference`'s contract (the window moved on in place; -> silu(conv) [B, T, X]): one Triton launch
    on CUDA for one token (`triton_step.py`), the torch reference elsewhere or under kernels.gdn=torch."""
    module = _step_module(mixed_BTX)
    if module is not None:
        if module.conv_supported(mixed_BTX, window_BXW):
            return module.conv_step_triton(mixed_BTX, window_BXW, weight_X1K)
        _say_decode_takes_the_reference("conv", f"input {tuple(mixed_BTX.shape)} {mixed_BTX.dtype}, window "
                                        f"{window_BXW.dtype}{'' if window_BXW.is_contiguous() else ' strided'}")
    return conv_step_reference(mixed_BTX, window_BXW, weight_X1K)


def conv_silu(mixed_BTX, window_BXW, weight_X1K):
    """GDN's causal conv and SiLU over the window then mixed's tokens -> (silu(conv) [B, T, X] in mixed's dtype, the
    window after mixed [B, X, W]). One Triton launch on CUDA where no gradient is needed (`triton_conv.py`: capture,
    scoring); elsewhere, under kernels.gdn=torch, and where a graph is recorded, `causal_conv_silu` over their cat."""
    window_after_BXW = conv_window_after(window_BXW, mixed_BTX)  # its own tensor: no view keeps a span alive
    graph = needs_grad(mixed_BTX, window_BXW, weight_X1K)
    module = None if graph or torch.compiler.is_compiling() else _step_module(mixed_BTX, "triton_conv")
    if module is not None:
        if module.serves(mixed_BTX, window_BXW, weight_X1K):
            return module.conv_silu_tokens(mixed_BTX, window_BXW, weight_X1K), window_after_BXW
        say_once(f"GDN capture conv: the Triton launch does not take input {mixed_BTX.dtype} strides "
                 f"{mixed_BTX.stride()}, window {window_BXW.dtype}, weight {weight_X1K.dtype} "
                 f"{'contiguous' if weight_X1K.is_contiguous() else 'strided'}; torch's conv runs it (said once)")
    full_BXS = torch.cat([window_BXW, mixed_BTX.transpose(1, 2)], dim=-1)
    return causal_conv_silu(full_BXS, weight_X1K).transpose(1, 2), window_after_BXW


@functools.cache
def _say_decode_takes_the_reference(part: str, inputs: str) -> None:
    log.warning("GDN decode step: the Triton %s kernel does not take %s; the torch reference runs it (several small "
                "kernels a layer; logged once)", part, inputs)


def _step_module(x: torch.Tensor, name: str = "triton_step"):
    """The kernel module `name` (the decode's triton_step by default) where it can serve x (CUDA, auto, Triton
    imports), else None."""
    if kernel_choice("gdn") != "auto" or not x.is_cuda:
        return None
    return optional_module(f"longstraw_kernels.gdn.{name}")


def triton_chunk():
    """longstraw_kernels.gdn.triton_chunk, or None where Triton does not import."""
    return optional_module("longstraw_kernels.gdn.triton_chunk")


def use_triton(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV=None, chunk_size=64) -> bool:
    """Whether a gradient-needing call takes `triton_chunk`: CUDA, auto, Triton imports, inputs it supports."""
    if kernel_choice("gdn") == "torch" or not v_BTGV.is_cuda:
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
    grad = needs_grad(*inputs)
    kernel = fla_forward() if v_BTGV.is_cuda and v_BTGV.dtype in (torch.bfloat16, torch.float16) else None
    fla_serves = kernel is not None and chunk_size == 64 and v_BTGV.shape[1] > 0
    if grad and use_triton(*inputs, chunk_size):
        forward = functools.partial(fla_chunk, kernel) if fla_serves else None
        return triton_chunk().gdn_chunked_triton(*inputs, scale, chunk_size, forward=forward)
    if not fla_serves or grad:
        return gdn_chunked(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, initial_state_BGKV, scale, chunk_size)
    return fla_chunk(kernel, *inputs, scale)
