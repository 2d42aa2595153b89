"""The decode step's GDN kernels (`triton_step.py`, Triton's interpreter on CPU) against their torch references.
The conv step: silu(conv) and the window moved on in place. The recurrence (`gdn_decode_reference`): the same
output and the same state, advanced in place, from raw q, k (before their norms), a and b (before the gates), for
strided inputs as the conv's split gives them, grouped value heads, a key dim that is not a power of two, and gate
inputs on both sides of softplus's threshold. On CUDA, tests/models/test_gpu_decode.py checks them at qwen36's
shape."""

import pytest
import torch

from conftest import rel_err
from longstraw_kernels.gdn.reference import (
    causal_conv_silu,
    conv_step_reference,
    gdn_decay,
    gdn_decode_reference,
    gdn_recurrent,
    l2norm,
)
from longstraw_kernels.gdn.triton_step import conv_step_triton, gdn_decode_triton


def inputs(B, H, G, K, V, dtype, seed=0):
    """Raw decode inputs; q, k, v as strided views of one [B, 1, X] row, as the conv's split leaves them."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(B, 1, 2 * H * K + G * V + 5, generator=g).to(dtype)
    q, k, v = mixed[..., : H * K], mixed[..., H * K : 2 * H * K], mixed[..., 2 * H * K : 2 * H * K + G * V]
    gates = torch.randn(B, 1, 2 * G, generator=g).to(dtype) * 4
    gates[0, 0, 0] = 30.0  # softplus above its threshold
    a, b = gates[..., :G], gates[..., G:]
    a_log = torch.empty(G).uniform_(0.01, 16, generator=g).log().to(dtype)
    dt_bias = torch.randn(G, generator=g).to(dtype)
    state = torch.randn(B, G, K, V, generator=g)
    return (q.reshape(B, 1, H, K), k.reshape(B, 1, H, K), v.reshape(B, 1, G, V), a, b, a_log, dt_bias), state


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("B, H, G, K, V", [(2, 2, 4, 16, 16), (3, 1, 3, 24, 20), (1, 2, 2, 32, 8)])
def test_decode_kernel_equals_the_reference(dtype, bound, B, H, G, K, V):
    args, state = inputs(B, H, G, K, V, dtype)
    kernel_state, ref_state = state.clone(), state.clone()
    o = gdn_decode_triton(*args, kernel_state)
    want = gdn_decode_reference(*args, ref_state)
    assert o.dtype == dtype and o.shape == (B, 1, G, V)
    assert rel_err(o, want) < bound
    assert rel_err(kernel_state, ref_state) < 1e-6 and not torch.equal(kernel_state, state)


def test_the_reference_is_the_model_recurrence_after_its_norms_and_gates():
    """gdn_decode_reference = l2norm'd q, k, gdn_decay, sigmoid, then gdn_recurrent (fp64), state in place; a second
    step continues from the first's state."""
    args, state = inputs(2, 2, 4, 16, 16, torch.float64)
    state = state.double()
    q, k, v, a, b, a_log, dt_bias = args
    want_o, want_state = gdn_recurrent(l2norm(q), l2norm(k), v, gdn_decay(a, a_log, dt_bias), b.sigmoid(), state)
    o = gdn_decode_reference(*args, state)
    assert torch.equal(o, want_o) and torch.equal(state, want_state)
    two = gdn_decode_triton(*(x.float() for x in args), state.float().contiguous())
    assert rel_err(two, gdn_decode_reference(*args, state)) < 1e-6


def test_refuses_what_it_does_not_take():
    args, state = inputs(2, 2, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="fp32 contiguous state"):
        gdn_decode_triton(*args, state.double())
    with pytest.raises(ValueError, match="one token"):
        gdn_decode_triton(*(x.expand(2, 2, *x.shape[2:]) for x in args[:5]), *args[5:], state)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("B, X, K", [(2, 300, 4), (3, 64, 3), (1, 17, 2)])
def test_conv_step_kernel_equals_the_reference(dtype, bound, B, X, K):
    """One token of the conv from a strided input (a slice of a wider row, as the fused input GEMM gives it):
    silu(conv) as the reference's, and the window moved on exactly (its old taps shifted, the input last);
    X not a multiple of the kernel's block, windows of 1 to 3 taps."""
    g = torch.Generator().manual_seed(X)
    mixed = torch.randn(B, 1, X + 7, generator=g).to(dtype)[..., 3 : 3 + X]
    weight = torch.randn(X, 1, K, generator=g).to(dtype)
    window = torch.randn(B, X, K - 1, generator=g).to(dtype)
    kernel_window, ref_window = window.clone(), window.clone()
    out = conv_step_triton(mixed, kernel_window, weight)
    want = conv_step_reference(mixed, ref_window, weight)
    assert out.dtype == dtype and out.shape == (B, 1, X) and rel_err(out, want) < bound
    assert torch.equal(kernel_window, ref_window)
    assert torch.equal(kernel_window[..., -1], mixed[:, 0]) and torch.equal(kernel_window[..., :-1], window[..., 1:])


def test_conv_step_reference_is_the_model_conv_over_window_and_input():
    """Two steps of conv_step_reference equal causal_conv_silu over (window, both tokens) at once (fp64)."""
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(2, 2, 10, generator=g, dtype=torch.float64)
    weight = torch.randn(10, 1, 4, generator=g, dtype=torch.float64)
    window = torch.randn(2, 10, 3, generator=g, dtype=torch.float64)
    full = torch.cat([window, mixed.transpose(1, 2)], -1)
    want = causal_conv_silu(full, weight).transpose(1, 2)
    steps = [conv_step_reference(mixed[:, t : t + 1], window, weight) for t in range(2)]
    assert torch.allclose(torch.cat(steps, 1), want, rtol=0, atol=1e-12)
    assert torch.equal(window, full[..., -3:])


def test_a_cuda_input_the_kernels_do_not_take_says_so_once_and_runs_the_reference(monkeypatch, caplog):
    """The dispatch (`fla_gpu.gdn_decode` / `conv_step`) where the kernels would serve but refuse the inputs (here a
    strided state and window, as seen from a CUDA device): the reference's result, one warning each, not repeated."""
    from longstraw_kernels.gdn import fla_gpu, triton_step

    monkeypatch.setattr(fla_gpu, "_step_module", lambda x: triton_step)
    fla_gpu._say_decode_takes_the_reference.cache_clear()
    args, state = inputs(2, 2, 4, 16, 16, torch.float32)
    strided = state.transpose(-1, -2).contiguous().transpose(-1, -2)
    window = torch.randn(2, 3, 12).transpose(1, 2)
    mixed = torch.randn(2, 1, 12)
    weight = torch.randn(12, 1, 4)
    with caplog.at_level("WARNING", logger=fla_gpu.__name__):
        for _ in range(2):
            want = gdn_decode_reference(*args, strided.clone())
            assert torch.equal(fla_gpu.gdn_decode(*args, strided.clone()), want)
            ref_window = window.clone()
            want = conv_step_reference(mixed, ref_window, weight)
            assert torch.equal(fla_gpu.conv_step(mixed, window.clone(), weight), want)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "recurrence" in said[0] and "strided" in said[0] and "conv" in said[1]
