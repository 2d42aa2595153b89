"""NF4 dequantisation (kernels/nf4) against torchao's NF4Tensor: the reference and the Triton kernel equal
`get_original_weight` bit for bit; the op dispatches and traces under torch.compile; `quantize.linear` (NF4Linear)
computes F.linear with the dequantised weight, and its gradient is that linear's; routed experts (`NF4Experts`) are
torchao's NF4 expert by expert, slice and clone without requantising, and glm52's dense expert pass over them traces
under torch.compile without graph breaks.

Runs everywhere: on CPU the Triton kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on a GPU
compiled (there also at the 27B shape's sizes).
"""

import pytest
import torch

from conftest import rel_err

pytest.importorskip("torchao")

from longstraw_cli.quantize import (  # noqa: E402
    NF4Experts,
    NF4Linear,
    dense,
    linear,
    nf4_parts,
    quantize_linears,
    scaler_block_size,
    torchao_nf4,
)
from longstraw_kernels import nf4 as nf4_ops  # noqa: E402
from longstraw_kernels import use_kernels  # noqa: E402
from longstraw_kernels.nf4 import reference, triton_nf4  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (N, K, scaler block): one scaler block; several (the factor's index); rows of 5 blocks; a whole last program
# and a partial one (the dequantisation takes 32 blocks a program)
SHAPES = [(64, 128, 64), (40, 320, 8), (128, 512, 256), (33, 64, 1)]


def nf4_weight(n, k, scaler_block, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    # an outlier row: large absmaxes in the scalers' quantisation
    w[1] *= 40
    return torchao_nf4().to_nf4(w.to(DEVICE), 64, scaler_block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantisation_is_torchaos_bit_for_bit(shape, dtype):
    q = nf4_weight(*shape, dtype)
    expected = q.get_original_weight()
    parts = nf4_parts(q)
    assert torch.equal(reference.dequantize_reference(parts), expected)
    assert torch.equal(triton_nf4.dequantize_triton(parts), expected)
    assert torch.equal(nf4_ops.dequantize(parts), expected)


@pytest.mark.parametrize("config", [(1, 1), (16, 4), (64, 8)])
def test_every_tile_shape_of_the_sweep_is_exact(config):
    # 33 x 64 weights: 33 blocks, a partial last program for each shape
    q = nf4_weight(33, 64, 1, torch.bfloat16)
    assert torch.equal(triton_nf4.dequantize_triton(nf4_parts(q), config), q.get_original_weight())


def test_dispatch():
    parts = nf4_parts(nf4_weight(64, 128, 64, torch.float32))
    use_kernels(nf4="torch")
    assert torch.equal(nf4_ops.dequantize(parts), reference.dequantize_reference(parts))


def quantised_linear(dtype=torch.float32):
    layer = torch.nn.Linear(256, 64, bias=True, dtype=dtype, device=DEVICE)
    holder = torch.nn.Sequential(layer)
    # quantize_linears takes a decoder layer's LoRA candidates: a plain container's linears qualify
    assert quantize_linears(holder) == 1
    assert type(holder[0]) is NF4Linear
    return holder[0]


def test_nf4_linear_gradient_is_the_dequantised_weights():
    layer = quantised_linear()
    w = layer.weight.get_original_weight()
    x = torch.randn(5, 7, 256, device=DEVICE, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = layer(x)
    ref = torch.nn.functional.linear(x_ref, w, layer.bias)
    assert rel_err(out, ref) <= 1e-6
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert rel_err(x.grad, x_ref.grad) <= 1e-6
    assert layer.weight.grad is None
    # no gradient asked: the same numbers without the autograd function
    with torch.no_grad():
        assert torch.equal(layer(x), linear(x, layer.weight, layer.bias))


def test_the_ops_trace_under_torch_compile_without_breaks():
    layer = quantised_linear()
    x = torch.randn(8, 256, device=DEVICE)

    def step(x):
        return torch.relu(layer(x)) * 2

    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), step(x))


class Experts(torch.nn.Module):
    """glm52's routed experts' parameters (models/glm52/model.py's `Experts`), E experts of [2I, C] and [C, I]."""

    def __init__(self, E=5, C=64, I=48, dtype=torch.float32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = torch.nn.Parameter((torch.randn(E, 2 * I, C, generator=g) * 0.02).to(dtype).to(DEVICE))
        self.down_proj = torch.nn.Parameter((torch.randn(E, C, I, generator=g) * 0.02).to(dtype).to(DEVICE))


def test_experts_are_torchaos_nf4_expert_by_expert():
    experts = Experts()
    plain = {n: p.detach().clone() for n, p in experts.named_parameters()}
    assert quantize_linears(experts) == 2
    for name, w in experts.named_parameters():
        assert type(w.data) is NF4Experts and w.shape == plain[name].shape and not w.requires_grad
        original = plain[name]
        want = [torchao_nf4().to_nf4(e.contiguous(), 64, scaler_block_size(e.numel())).get_original_weight()
                for e in original]
        assert all(torch.equal(dense(w[e]), want[e]) for e in range(len(want)))
        assert torch.equal(dense(w), torch.stack(want))
        # expert parallel's slice (ep_shard: detach, [a:b], clone) keeps the bits: no requantisation
        assert torch.equal(dense(w.detach()[1:4].clone()), torch.stack(want[1:4]))
        assert [torch.equal(dense(e), x) for e, x in zip(w.unbind(0), want)] == [True] * len(want)
    # a second call finds nothing left to quantise
    assert quantize_linears(experts) == 0


def test_experts_refuse_what_they_do_not_support():
    experts = Experts()
    quantize_linears(experts)
    for bad in (lambda w: w + 1, lambda w: w[:, 3], lambda w: w.sum()):
        with pytest.raises(NotImplementedError) as e:
            bad(experts.gate_up_proj)
        assert "supports detach, clone, w[a:b], w[e] and unbind(0)" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_routed_nf4_experts_compute_the_dequantised_experts(dtype):
    """glm52's `local_experts` over NF4 experts (each routed expert dequantised, Triton on CUDA) against the same
    function over their dequantised tensors: output, and gradients of the tokens and routing weights (the same
    products of the same values)."""
    from longstraw_cli.models.glm52.experts import local_experts

    experts = Experts(E=6, dtype=dtype)
    quantize_linears(experts)
    plain = [dense(experts.gate_up_proj), dense(experts.down_proj)]
    g = torch.Generator().manual_seed(2)
    x_NC = torch.randn(7, 64, generator=g).to(dtype).to(DEVICE)
    topk_idx_Nk = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(7)]).to(DEVICE)
    topk_w_Nk = torch.rand(7, 2, generator=g).to(DEVICE)
    outs = []
    for weights in ([experts.gate_up_proj, experts.down_proj], plain):
        x, w = x_NC.clone().requires_grad_(), topk_w_Nk.clone().requires_grad_()
        y = local_experts(x, topk_idx_Nk, w, *weights)
        y.float().square().sum().backward()
        outs.append((y.detach(), x.grad, w.grad))
    for got, want in zip(*outs):
        assert rel_err(got, want) <= 1e-6


def test_dense_experts_trace_under_torch_compile_without_breaks(monkeypatch):
    """glm52's static decode step reads NF4 experts through `dense_experts` (here in passes of 2, 2, 1): one
    graph."""
    from longstraw_cli import quantize
    from longstraw_cli.models.glm52.experts import dense_experts

    monkeypatch.setattr(quantize, "NF4_EXPERTS_PER_PASS", 2)
    experts = Experts(E=5)
    quantize_linears(experts)
    g = torch.Generator().manual_seed(1)
    x_NC = torch.randn(4, 64, generator=g).to(DEVICE)
    topk_idx_Nk = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(4)]).to(DEVICE)
    topk_w_Nk = torch.rand(4, 2, generator=g).to(DEVICE)

    def step(x_NC):
        return dense_experts(x_NC, topk_idx_Nk, topk_w_Nk, experts.gate_up_proj, experts.down_proj)

    explained = torch._dynamo.explain(step)(x_NC)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x_NC), step(x_NC))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n, k", [(5120, 17408), (17408, 5120), (6144, 5120)])
def test_kernel_at_the_27b_shapes_on_cuda(n, k):
    q = nf4_weight(n, k, 256, torch.bfloat16)
    assert torch.equal(triton_nf4.dequantize_triton(nf4_parts(q)), q.get_original_weight())
