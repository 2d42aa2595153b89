"""QLoRA's frozen base: `lora.quantize=nf4` stores the base linears and the routed experts of every decoder layer
as torchao NF4 tensors.

NF4 (Dettmers et al., QLoRA) with double quantisation, as torchtune's QLoRA stores it (torchao's `NF4Tensor`):
each block of 64 weights keeps 4-bit codes of a normal-float table and one absmax scaler; the scalers
themselves are quantised to int8 in blocks of 256 (one factor per block, in the model dtype, plus their mean).
A linear with an NF4 weight (`linear`: quantised nn.Linears become `NF4Linear`, LoRA's wrapper calls it too)
dequantises the weight on every call, in one Triton pass on CUDA (`longstraw_kernels.nf4`: torchao's numbers bit
for bit, 17x faster than its `get_original_weight`; the torch reference on CPU), then runs F.linear. Its backward
dequantises again instead of keeping the bf16 weight in the replay's graph. The gradient flows to the input,
never to the frozen weight. Adapters, norms, embeddings and lm_head stay in the model dtype.

What is quantised: every nn.Linear a LoRA adapter may target (`base_weights.candidate_linears`: all of a decoder
layer's linears but glm52's DSA indexer, which runs under no_grad; never embeddings or lm_head), targeted or not,
whose size is a whole number of 64-weight blocks; and glm52's routed experts (`base_weights.routed_experts`, 3-D
[E, out, in]), expert by expert: each expert's matrix is an NF4 tensor of its own, as a linear's weight is
(`NF4Experts` holds them, in the 3-D parameter's place). The experts' compute (models/glm52/experts.py) takes
them one at a time through `linear` (only the experts some token is routed to), or, in the static decode step,
`experts_per_pass` at a time through `dense`: the whole expert tensor is never dequantised at once. LoRA adapts no
expert, so they are frozen either way. Not quantised: norms, glm52's router gate.

Simplification: where a weight's number of blocks is not a multiple of 256 (tiny test shapes only; every linear
and expert of qwen36 / qwen36_mini / glm52 has a multiple), the scalers are quantised in the largest power-of-two
block that divides it instead. `nf4_bytes` is the storage this layout takes, tensor by tensor (expert by expert),
as `longstraw plan` counts it.

torchao is an optional extra (`pip install longstraw[qlora]`), imported only when nf4 is asked for.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

import longstraw_kernels.nf4 as nf4_ops
from longstraw_cli.base_weights import candidate_linears, routed_experts

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
    global _NF4_TENSOR
    _NF4_TENSOR = nf4_tensor.NF4Tensor
    return nf4_tensor


# torchao's NF4Tensor once `torchao_nf4` imported it: nothing is NF4 before (no import for models that never
# quantise), and is_nf4 reads a global that torch.compile traces (the import's logging would break its graph)
_NF4_TENSOR: type | None = None


def is_nf4(t: torch.Tensor | None) -> bool:
    return _NF4_TENSOR is not None and isinstance(t, _NF4_TENSOR)


def nf4_parts(weight: torch.Tensor) -> nf4_ops.NF4Parts:
    """An NF4 weight's storage, as the kernels take it (no copy)."""
    return nf4_ops.NF4Parts(weight.quantized_data, weight.quantized_scalers, weight.quantization_factor,
                            weight.scaler_mean, weight.nf4, tuple(weight.shape), weight.scaler_block_size)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor in its own dtype: an NF4 weight dequantised (a new tensor), NF4 experts every
    expert dequantised and stacked (the whole tensor: for a slice of them, or to export), else itself."""
    if is_nf4(weight):
        return nf4_ops.dequantize(nf4_parts(weight))
    if isinstance(weight, NF4Experts):
        # unbind, not the `experts` attribute: torch.compile traces it (the attribute would break its graph)
        return torch.stack([dense(expert) for expert in weight.unbind(0)])
    return weight


def _map_inner(weight: torch.Tensor, fn) -> torch.Tensor:
    """An NF4 weight with `fn` applied to each of its inner tensors (same device and dtype)."""
    names, ctx = weight.__tensor_flatten__()
    return type(weight).__tensor_unflatten__({n: fn(getattr(weight, n)) for n in names}, ctx, weight.shape,
                                             weight.stride())


class NF4Experts(torch.Tensor):
    """Routed-expert weights [E, out, in] stored expert by expert: `experts[e]` is expert e's NF4 matrix, as
    `to_nf4` quantises a linear's weight. It stands in the 3-D Parameter's place (same name, shape and dtype) and
    supports what the code around the experts does with that Parameter: detach, clone, slicing experts
    (`w[a:b]`, expert parallel's slice), one expert (`w[e]`) and `unbind(0)` (the experts' matrices, which
    `linear` and `dense` take). Anything else (arithmetic on the whole tensor) is refused: read the experts
    through those. Frozen: it never requires grad."""

    experts: tuple[torch.Tensor, ...]

    @staticmethod
    def __new__(cls, experts):
        if not experts:
            raise ValueError("NF4Experts needs at least one expert")
        first = experts[0]
        return torch.Tensor._make_wrapper_subclass(cls, (len(experts), *first.shape), dtype=first.dtype,
                                                   device=first.device, requires_grad=False)

    def __init__(self, experts):
        self.experts = tuple(experts)
        # one attribute per expert: the inner tensors torch.compile flattens (`__tensor_flatten__`)
        for e, expert in enumerate(self.experts):
            setattr(self, f"expert_{e}", expert)

    def __tensor_flatten__(self):
        return [f"expert_{e}" for e in range(len(self.experts))], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return NF4Experts([inner[f"expert_{e}"] for e in range(len(inner))])

    def __repr__(self) -> str:
        return f"NF4Experts(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        aten, w = torch.ops.aten, args[0]
        if func is aten.detach.default:
            return NF4Experts([expert.detach() for expert in w.experts])
        if func is aten.clone.default:
            # inner tensors copied: torchao's own clone quantises the dequantised weight again
            return NF4Experts([_map_inner(expert, torch.clone) for expert in w.experts])
        dim, *rest = _op_args(func, args[1:], kwargs)
        if dim == 0 and func is aten.slice.Tensor:
            start, end, step = rest
            return NF4Experts(w.experts[start:end:step])
        # views of existing tensors must be new tensors (autograd's view tracking): detached ones, no copy
        if dim == 0 and func is aten.select.int:
            return w.experts[rest[0]].detach()
        if dim == 0 and func is aten.unbind.int:
            return [expert.detach() for expert in w.experts]
        where = "" if dim is None else f" along dim {dim}"
        raise NotImplementedError(f"NF4Experts (lora.quantize=nf4's routed experts) supports detach, clone, "
                                  f"w[a:b], w[e] and unbind(0); got {func}{where}")

    __torch_function__ = torch._C._disabled_torch_function_impl


# the indexing ops NF4Experts takes: their arguments after the tensor, with their defaults (aten's schemas)
_OP_DEFAULTS = {"slice.Tensor": {"dim": 0, "start": None, "end": None, "step": 1},
                "select.int": {"dim": 0, "index": 0}, "unbind.int": {"dim": 0}}


def _op_args(func, args, kwargs) -> list:
    """[dim, ...] of an indexing op's call (positional or keyword); [None] for any other op."""
    defaults = _OP_DEFAULTS.get(f"{func._opname}.{func._overloadname}")
    if defaults is None:
        return [None]
    values = dict(defaults)
    values.update(zip(defaults, args))
    values.update(kwargs or {})
    return list(values.values())


def is_nf4_experts(t: torch.Tensor | None) -> bool:
    return isinstance(t, NF4Experts)


# NF4 experts a dense pass (the static decode step's `dense_experts`) dequantises at once: the model-dtype copy is
# this many experts' weights (604 MB for the GLM-5 shape in bf16). On CPU (32 experts of glm52_mini's at half
# width, 8 tokens) passes of 1, 8 and 32 experts took the same time within the shared machine's noise (10-23 s a
# call, dequantisation dominating); the pass size was not measured on a GPU
NF4_EXPERTS_PER_PASS = 8


def experts_per_pass(weight: torch.Tensor) -> int:
    """Experts of a 3-D expert weight that a dense pass reads at once: all of a plain tensor (one batched
    matmul), NF4_EXPERTS_PER_PASS of NF4 experts."""
    return min(weight.shape[0], NF4_EXPERTS_PER_PASS) if is_nf4_experts(weight) else weight.shape[0]


class _NF4Product(torch.autograd.Function):
    """x @ W^T for a frozen NF4 W: the backward dequantises W again (the graph keeps the 4-bit weight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.parts = nf4_parts(weight)
        return F.linear(x, nf4_ops.dequantize(ctx.parts).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ nf4_ops.dequantize(ctx.parts).to(grad.dtype), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with NF4 weights through the kernels (see the module docstring)."""
    if not is_nf4(weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and x.requires_grad:
        out = _NF4Product.apply(x, weight)
    else:
        out = F.linear(x, dense(weight).to(x.dtype))
    return out if bias is None else out + bias


class NF4Linear(nn.Linear):
    """An nn.Linear whose weight `quantize_linears` made NF4 (its class is swapped in place: same parameters and
    state-dict keys); its forward goes through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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


def storage_anchor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor whose storage stands for `t`'s (memory telemetry's key): an NF4 weight, which wraps tensors
    and has no storage of its own, by its codes (NF4 experts: the first expert's), else `t` itself."""
    if is_nf4_experts(t):
        t = t.experts[0]
    return t.quantized_data if is_nf4(t) else t


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor's storage holds: an NF4 tensor's inner tensors summed (NF4 experts: every expert's), else
    its own storage."""
    if is_nf4_experts(t):
        return sum(storage_bytes(expert) for expert in t.experts)
    if is_nf4(t):
        names, _ = t.__tensor_flatten__()
        return sum(getattr(t, name).untyped_storage().nbytes() for name in names)
    return t.untyped_storage().nbytes()


def quantizable(linear: nn.Linear) -> bool:
    return scaler_block_size(linear.weight.numel()) is not None


@torch.no_grad()
def quantize_linears(module: nn.Module) -> int:
    """The frozen base of `module` to NF4 (the bf16/fp32 tensors are freed): the weight of every quantisable
    LoRA-candidate nn.Linear, and every routed-expert weight expert by expert (`NF4Experts`; where an expert's
    matrix is a whole number of blocks). -> how many tensors were quantised. Run it on one decoder layer at a
    time (models/__init__.py's `_by_parts`)."""
    nf4 = torchao_nf4()
    count = 0
    for linear in candidate_linears(module).values():
        w = linear.weight
        if is_nf4(w) or not quantizable(linear):
            continue
        q = nf4.to_nf4(w.detach().contiguous(), BLOCK_SIZE, scaler_block_size(w.numel()))
        linear.weight = nn.Parameter(q, requires_grad=False)
        if type(linear) is nn.Linear:
            linear.__class__ = NF4Linear
        count += 1
    for owner, name in routed_experts(module):
        w = getattr(owner, name)
        scaler_block = scaler_block_size(w[0].numel())
        if is_nf4_experts(w) or scaler_block is None:
            continue
        experts = [nf4.to_nf4(expert.contiguous(), BLOCK_SIZE, scaler_block) for expert in w.detach().unbind(0)]
        setattr(owner, name, nn.Parameter(NF4Experts(experts), requires_grad=False))
        count += 1
    return count


def nf4_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose own `weight` is NF4, in module order."""
    return [m for m in model.modules() if is_nf4(m._parameters.get("weight"))]


@contextlib.contextmanager
def dense_copies(model: nn.Module, count: int):
    """Within: the first `count` NF4 linears of `model` (module order) hold their dequantised weights as plain
    frozen Parameters, so their products skip the dequantisation (the same numbers: `linear` multiplies by
    exactly these values); the NF4 Parameters are put back on exit and the copies freed. The native rollout's
    `rollout.native.nf4_cache` (trainer.py) sizes `count`."""
    swapped = []
    try:
        for module in nf4_modules(model)[:count] if count > 0 else []:
            weight = module.weight
            module.weight = nn.Parameter(dense(weight), requires_grad=False)
            swapped.append((module, weight))
        yield len(swapped)
    finally:
        for module, weight in swapped:
            module.weight = weight


def _dense_sizes(model: nn.Module) -> list[int]:
    """Bytes of each NF4 linear's dequantised weight, in module order."""
    return [m.weight.numel() * m.weight.element_size() for m in nf4_modules(model)]


class DenseCache:
    """How many NF4 linears the rollouts hold dequantised (`dense_copies`): as many as the first budget holds, in
    module order; kept while later budgets hold it (the compiled decode step then sees the same weights every
    rollout), made smaller, never larger, when one does not."""

    def __init__(self):
        self.count: int | None = None

    def size(self, model: nn.Module, budget_bytes: int) -> tuple[int, int, bool]:
        """-> (count, its bytes, whether the count changed) for a rollout with `budget_bytes` to spare."""
        sizes = _dense_sizes(model)
        fits, used = 0, 0
        while fits < len(sizes) and used + sizes[fits] <= budget_bytes:
            used, fits = used + sizes[fits], fits + 1
        changed = self.count is None or fits < self.count
        if changed:
            self.count = fits
        return self.count, sum(sizes[:self.count]), changed


def quantized_linears(model: nn.Module) -> int:
    """How many linears of a model hold NF4 weights."""
    return sum(is_nf4(p) for p in model.parameters())


def quantized_experts(model: nn.Module) -> int:
    """How many routed-expert weights of a model are NF4 experts."""
    return sum(is_nf4_experts(p) for p in model.parameters())


__all__ = ["NF4Experts", "NF4Linear", "NF4_DTYPES", "QUANTIZE_CHOICES", "dense", "dense_copies", "DenseCache",
           "dtype_refusal", "experts_per_pass", "is_nf4", "is_nf4_experts", "linear", "nf4_bytes", "nf4_modules",
           "nf4_parts", "quantize_linears", "quantized_experts", "quantized_linears", "scaler_block_size",
           "storage_anchor", "storage_bytes", "torchao_nf4"]
