"""NF4 dequantisation (kernels/nf4) against torchao's NF4Tensor: the reference and the Triton kernel equal
`get_original_weight` bit for bit; the op dispatches and traces under torch.compile; `quantize.linear` (NF4Linear)
computes F.linear with the dequantised weight, and its gradient is that linear's.

Runs everywhere: on CPU the Triton kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on a GPU
compiled (there also at the 27B shape's sizes).
"""

import pytest
import torch

from conftest import rel_err

pytest.importorskip("torchao")

from longstraw_cli.quantize import NF4Linear, linear, nf4_parts, quantize_linears, torchao_nf4  # noqa: E402
from longstraw_kernels import nf4 as nf4_ops  # noqa: E402
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


def test_dispatch(monkeypatch):
    parts = nf4_parts(nf4_weight(64, 128, 64, torch.float32))
    monkeypatch.setenv("LONGSTRAW_NF4_KERNEL", "torch")
    assert torch.equal(nf4_ops.dequantize(parts), reference.dequantize_reference(parts))
    monkeypatch.setenv("LONGSTRAW_NF4_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"LONGSTRAW_NF4_KERNEL='fast'; valid: \['auto', 'torch'\]"):
        nf4_ops.dequantize(parts)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n, k", [(5120, 17408), (17408, 5120), (6144, 5120)])
def test_kernel_at_the_27b_shapes_on_cuda(n, k):
    q = nf4_weight(n, k, 256, torch.bfloat16)
    assert torch.equal(triton_nf4.dequantize_triton(nf4_parts(q)), q.get_original_weight())
