"""GDN's causal conv and SiLU over many tokens (`triton_conv.py`, Triton's interpreter on CPU, the GPU under
`-m gpu`) against `causal_conv_silu` over the window and the tokens, the window after them, and the dispatch: the
kernel only where no graph is recorded."""

import logging

import pytest
import torch

from conftest import rel_err
from longstraw_kernels.gdn import conv_silu, triton_conv
from longstraw_kernels.gdn.reference import causal_conv_silu, conv_window_after

# Triton's interpreter rounds fp32 to bf16 toward zero (tests/kernels/test_decode_linear.py), twice on the way
BOUND = {torch.bfloat16: 2**-6, torch.float32: 1e-6}


def operands(B, T, X, K, dtype, seed, wide=1):
    """mixed [B, T, X] (with wide > 1 the first X of every wide * X: rows of a wider GEMM output), the window
    [B, X, K - 1], the conv weight [X, 1, K]."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(B, T, wide * X, generator=g).to(dtype)[..., :X]
    return mixed, torch.randn(B, X, K - 1, generator=g).to(dtype), (torch.randn(X, 1, K, generator=g) * 0.5).to(dtype)


def reference(mixed, window, weight):
    full = torch.cat([window, mixed.transpose(1, 2)], dim=-1)
    return causal_conv_silu(full, weight).transpose(1, 2), full[..., full.shape[-1] - window.shape[-1]:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B, T, X, K, wide", [(2, 37, 200, 4, 1), (1, 2, 130, 4, 2), (3, 65, 64, 2, 1)])
def test_kernel_equals_the_reference(dtype, B, T, X, K, wide):
    """Awkward token and channel counts, a span shorter than the window (most taps read the window), rows read in
    place from a wider tensor."""
    mixed, window, weight = operands(B, T, X, K, dtype, seed=T, wide=wide)
    assert triton_conv.serves(mixed, window, weight)
    got = triton_conv.conv_silu_tokens(mixed, window, weight)
    want, window_after = reference(mixed, window, weight)
    assert got.shape == (B, T, X) and got.is_contiguous() and got.dtype == dtype
    assert rel_err(got, want) < BOUND[dtype]
    assert torch.equal(conv_window_after(window, mixed), window_after)


def test_off_cuda_the_reference_runs_with_its_gradients():
    mixed, window, weight = operands(2, 9, 16, 4, torch.float32, seed=0)
    weight.requires_grad_()
    got, window_after = conv_silu(mixed, window, weight)
    want, want_after = reference(mixed, window, weight)
    assert torch.equal(got, want) and torch.equal(window_after, want_after)
    assert window_after._base is None  # its own tensor: a stored window keeps no span's conv input alive
    got.sum().backward()
    assert weight.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_at_qwen36_minis_shape(monkeypatch, caplog):
    """bf16, one sequence of 4,096 tokens of qwen36_mini's 4,096 conv channels on the GPU (rounding to nearest
    there): a last bit rarely, from the fp32 sum's order; taken by the dispatch under no_grad only."""
    from longstraw_kernels import say_once, use_kernels

    calls = []
    kernel = triton_conv.conv_silu_tokens
    monkeypatch.setattr(triton_conv, "conv_silu_tokens", lambda *a: calls.append(1) or kernel(*a))
    mixed, window, weight = (t.cuda() for t in operands(1, 4096, 4096, 4, torch.bfloat16, seed=1))
    want, want_after = reference(mixed, window, weight)
    with torch.no_grad():
        got, window_after = conv_silu(mixed, window, weight)
    assert calls and rel_err(got, want) < 2**-9 and (got != want).float().mean() < 0.01
    assert torch.equal(window_after, want_after)
    calls.clear()
    weight.requires_grad_()
    conv_silu(mixed, window, weight)[0].float().sum().backward()
    with torch.no_grad(), use_kernels(gdn="torch"):
        conv_silu(mixed, window, weight)
    assert not calls
    # a layout the launch does not take (a strided weight): torch's conv, said once
    strided = torch.zeros(*weight.shape[:-1], 2 * weight.shape[-1], dtype=weight.dtype, device="cuda")[..., ::2]
    strided.copy_(weight.detach())
    say_once.cache_clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="longstraw_kernels"):
        got, _ = conv_silu(mixed, window, strided)
        conv_silu(mixed, window, strided)
    assert not calls and torch.equal(got, want)
    assert len([r for r in caplog.records if "GDN capture conv" in r.getMessage()]) == 1
