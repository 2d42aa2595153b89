"""QLoRA's frozen base: `lora.quantize=nf4` stores the base linears of every decoder layer as torchao NF4 tensors.

NF4 (Dettmers et al., QLoRA) with double quantisation, as torchtune's QLoRA stores it (torchao's `NF4Tensor`):
each block of 64 weights keeps 4-bit codes of a normal-float table and one absmax scaler; the scalers
themselves are quantised to int8 in blocks of 256 (one factor per block, in the model dtype, plus their mean).
A linear with an NF4 weight dequantises it to the activations' dtype on every call and runs F.linear (torchao's
`linear_nf4`, which torch.nn.functional.linear reaches through the tensor's __torch_function__); the gradient
flows to the input, never to the frozen weight. Adapters, norms, embeddings and lm_head stay in the model dtype.

What is quantised: every nn.Linear a LoRA adapter may target (`lora._candidate_linears`: all of a decoder
layer's linears but glm52's DSA indexer, which runs under no_grad; never embeddings or lm_head), targeted or not,
whose size is a whole number of 64-weight blocks. Not: norms, glm52's router gate and its routed experts. The
experts are 3-D parameters ([E, 2I, C], sliced by expert parallelism, read one expert at a time or densely by
decode) and torchao's NF4 takes 2-D tensors only; they stay in the model dtype (for the GLM-5 shape that is
most of its weights: nf4 shrinks only its attention, shared-expert and dense-layer linears).

Simplification: where a linear's number of blocks is not a multiple of 256 (tiny test shapes only; every linear
of qwen36 / qwen36_mini / glm52 has a multiple), the scalers are quantised in the largest power-of-two block that
divides it instead. `nf4_bytes` is the storage this layout takes, tensor by tensor, as `longstraw plan` counts it.

torchao is an optional extra (`pip install longstraw[qlora]`), imported only when nf4 is asked for.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

QUANTIZE_CHOICES = ("none", "nf4")
# the compute dtypes nf4 runs in (tested: logits and gradients against the dequantised model in each; float64
# for the exactness tests); float16 is refused (not tested)
NF4_DTYPES = ("bfloat16", "float32", "float64")
BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256
# torchao's normal-float lookup table: 16 entries in the weight's dtype, held by every NF4 tensor
NF4_TABLE = 16


def dtype_refusal(quantize: str, dtype: str) -> str | None:
    """One line when lora.quantize does not compute in model.dtype (the trainer's config and `longstraw plan`
    refuse the same), else None."""
    if quantize != "none" and dtype not in NF4_DTYPES:
        return (f"lora.quantize={quantize} computes in model.dtype, which must be one of {list(NF4_DTYPES)}; got "
                f"model.dtype={dtype!r}")
    return None


def torchao_nf4():
    """torchao's NF4 module (to_nf4, NF4Tensor, linear_nf4), or a one-line error saying how to install it."""
    # torchao warns at import that its CUDA C extensions (mxfp8, cutlass) do not load where the CUDA or torch
    # build differs from its wheel's (the NF4 path is pure torch and uses neither), and torch's pytree about an
    # enum torchao registers: neither concerns a user of nf4
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as e:
        raise ImportError(f"lora.quantize=nf4 needs torchao (pip install 'longstraw[qlora]' or torchao>=0.18): "
                          f"{e}") from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return nf4_tensor


def is_nf4(t: torch.Tensor) -> bool:
    # nothing can be an NF4 tensor before torchao was imported: no import for models that never quantise
    if "torchao" not in sys.modules:
        return False
    return isinstance(t, torchao_nf4().NF4Tensor)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor in its own dtype: an NF4 weight dequantised (a new tensor), else itself."""
    return weight.get_original_weight() if is_nf4(weight) else weight


def scaler_block_size(numel: int) -> int | None:
    """The scalers' block for a weight of `numel` elements: 256, or the largest power of two below it that
    divides the number of 64-weight blocks; None when the weight is not a whole number of blocks (not quantised)."""
    if numel % BLOCK_SIZE:
        return None
    blocks = numel // BLOCK_SIZE
    return min(SCALER_BLOCK_SIZE, blocks & -blocks)


def nf4_bytes(numel: int, itemsize: int) -> int:
    """Storage of one NF4 weight: two 4-bit codes a byte, an int8 scaler per 64-block, a factor per scaler block
    and the scalers' mean in the weight's dtype, and the 16-entry table; `numel * itemsize` if not quantisable."""
    scaler_block = scaler_block_size(numel)
    if scaler_block is None:
        return numel * itemsize
    blocks = numel // BLOCK_SIZE
    factors = blocks // scaler_block
    # torchao keeps one factor per scaler block, sliced out of a [factors, scaler_block] tensor and made
    # contiguous; a single factor's slice is contiguous already and keeps that whole buffer alive
    factor_storage = factors if factors > 1 else scaler_block
    return numel // 2 + blocks + (factor_storage + 1 + NF4_TABLE) * itemsize


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor's storage holds: an NF4 tensor's inner tensors summed, else its own storage."""
    if is_nf4(t):
        names, _ = t.__tensor_flatten__()
        return sum(getattr(t, name).untyped_storage().nbytes() for name in names)
    return t.untyped_storage().nbytes()


def quantizable(linear: nn.Linear) -> bool:
    return scaler_block_size(linear.weight.numel()) is not None


@torch.no_grad()
def quantize_linears(module: nn.Module) -> int:
    """Replace the weight of every quantisable LoRA-candidate nn.Linear under `module` by a frozen NF4 Parameter
    (the bf16/fp32 one is freed); -> how many. Run it on one decoder layer at a time."""
    from longstraw_cli.lora import _candidate_linears

    nf4 = torchao_nf4()
    count = 0
    for linear in _candidate_linears(module).values():
        w = linear.weight
        if is_nf4(w) or not quantizable(linear):
            continue
        q = nf4.to_nf4(w.detach().contiguous(), BLOCK_SIZE, scaler_block_size(w.numel()))
        linear.weight = nn.Parameter(q, requires_grad=False)
        count += 1
    return count


def quantized_linears(model: nn.Module) -> int:
    """How many linears of a model hold NF4 weights."""
    return sum(is_nf4(p) for p in model.parameters())


__all__ = ["NF4_DTYPES", "QUANTIZE_CHOICES", "dense", "dtype_refusal", "is_nf4", "nf4_bytes", "quantize_linears",
           "quantized_linears", "scaler_block_size", "storage_bytes", "torchao_nf4"]
