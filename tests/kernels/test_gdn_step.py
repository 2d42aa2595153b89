"""The decode step's GDN kernels (`triton_step.py`, Triton's interpreter on CPU) against their torch references.
The conv step: silu(conv) and the window moved on in place. The recurrence (`gdn_decode_reference`): the same
output and the same state, advanced in place, from raw q, k (before their norms), a and b (before the gates), for
strided inputs as the conv's split gives them, grouped value heads, a key dim that is not a power of two, and gate
inputs on both sides of softplus's threshold. The one-launch form (conv and recurrence, the conv's window as a ring)
against the two launches and the references over steps that wrap the ring, and the decoder through it. On CUDA,
tests/models/test_gpu_decode.py checks the two launches at qwen36's shape, and the one launch against them."""

import pytest
import torch

from conftest import rel_err
from longstraw_kernels.gdn.reference import (
    causal_conv_silu,
    conv_ring_step_reference,
    conv_step_reference,
    gdn_decay,
    gdn_decode_reference,
    gdn_recurrent,
    l2norm,
    ring_from_window,
    ring_window,
)
from longstraw_kernels.gdn.triton_step import conv_gdn_decode_triton, conv_step_triton, gdn_decode_triton


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


def split_conv(conv_B1X, H, G, K, V):
    B = conv_B1X.shape[0]
    q, k, v = conv_B1X.split([H * K, H * K, G * V], dim=-1)
    return q.reshape(B, 1, H, K), k.reshape(B, 1, H, K), v.reshape(B, 1, G, V)


def test_ring_window_is_the_moving_window():
    """Seven steps of conv_ring_step_reference (the ring of W + 1 = 4 slots wraps twice) give conv_step_reference's
    outputs and windows exactly (fp64), and the ring of a window is that window at step 0."""
    g = torch.Generator().manual_seed(1)
    window = torch.randn(2, 10, 3, generator=g, dtype=torch.float64)
    weight = torch.randn(10, 1, 4, generator=g, dtype=torch.float64)
    ring = ring_from_window(window)
    assert ring.shape == (2, 10, 4) and torch.equal(ring_window(ring, 0), window)
    for t in range(7):
        mixed = torch.randn(2, 1, 10, generator=g, dtype=torch.float64)
        assert torch.equal(conv_ring_step_reference(mixed, ring, weight, t), conv_step_reference(mixed, window, weight))
        assert torch.equal(ring_window(ring, t + 1), window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, H, G, K, V, taps", [(2, 2, 4, 16, 16, 4), (3, 1, 3, 24, 20, 4), (1, 2, 2, 32, 8, 2)])
def test_one_launch_equals_the_two_launches_and_the_references(dtype, B, H, G, K, V, taps):
    """`conv_gdn_decode_triton` over five steps (the ring wraps): the same output and state as the conv kernel then
    the recurrence kernel, bit for bit (the conv's output rounded to the input's dtype between them in both), the
    ring holding the two launches' window; against the torch references within fp32's rounding. Strided inputs (a
    slice of the fused input GEMM's row), grouped value heads, a key dim and value dim that are not the kernel's
    blocks, windows of 1 and 3 taps."""
    X = 2 * H * K + G * V
    g = torch.Generator().manual_seed(B * K + taps)
    weight = torch.randn(X, 1, taps, generator=g).to(dtype)
    window = torch.randn(B, X, taps - 1, generator=g).to(dtype)
    a_log = torch.empty(G).uniform_(0.01, 16, generator=g).log().to(dtype)
    dt_bias = torch.randn(G, generator=g).to(dtype)
    state = torch.randn(B, G, K, V, generator=g)
    ring, two_window, two_state = ring_from_window(window), window.clone(), state.clone()
    ref_ring, ref_state = ring.clone(), state.clone()
    for t in range(5):
        mixed = torch.randn(B, 1, X + 5, generator=g).to(dtype)[..., 2 : 2 + X]
        gates = torch.randn(B, 1, 2 * G, generator=g).to(dtype) * 4
        a, b = gates[..., :G], gates[..., G:]
        o = conv_gdn_decode_triton(mixed, ring, weight, torch.tensor([t]), a, b, a_log, dt_bias, state, H)
        two = gdn_decode_triton(*split_conv(conv_step_triton(mixed, two_window, weight), H, G, K, V), a, b, a_log,
                                dt_bias, two_state)
        assert o.dtype == dtype and o.shape == (B, 1, G, V)
        assert torch.equal(o, two) and torch.equal(state, two_state)
        assert torch.equal(ring_window(ring, t + 1), two_window)
        ref = gdn_decode_reference(*split_conv(conv_ring_step_reference(mixed, ref_ring, weight, t), H, G, K, V), a, b,
                                   a_log, dt_bias, ref_state)
        assert torch.equal(ring, ref_ring)
        if dtype == torch.float32:
            assert rel_err(o, ref) < 1e-6 and rel_err(state, ref_state) < 1e-6


def test_one_launch_refuses_what_it_does_not_take():
    X, H, G, K, V = 2 * 2 * 16 + 4 * 16, 2, 4, 16, 16
    mixed, ring = torch.randn(2, 1, X), torch.zeros(2, X, 4)
    weight, step = torch.randn(X, 1, 4), torch.tensor([0])
    a = b = torch.randn(2, 1, G)
    state = torch.randn(2, G, K, V)
    with pytest.raises(ValueError, match="X = 2 H K \\+ G V channels"):
        conv_gdn_decode_triton(mixed[..., 1:], ring[:, 1:], weight[1:], step, a, b, a[0, 0], b[0, 0], state, H)
    with pytest.raises(ValueError, match="fp32 contiguous state"):
        conv_gdn_decode_triton(mixed, ring, weight, step, a, b, a[0, 0], b[0, 0], state.double(), H)
    with pytest.raises(ValueError, match="ring"):
        conv_gdn_decode_triton(mixed, ring[..., :3], weight, step, a, b, a[0, 0], b[0, 0], state, H)


def test_qwen36_decode_through_the_one_launch_equals_the_modules(monkeypatch, fresh_dynamo):
    """LONGSTRAW_DECODE_GDN=fused: the decoder's GDN layers hold their windows as rings and run the one launch
    (Triton's interpreter here), with the references' logits over three steps in fp32 (the ring's wrap: above);
    another value is refused; a compiled step (`aot_eager`) equals the eager one."""
    from conftest import assert_compiled_step_equals_eager, assert_fused_kernel_decodes, ids, random_model

    model = random_model("qwen36_tiny", torch.float32)
    resident = model.capture(ids(40, 0), block_size=16)
    assert_fused_kernel_decodes(monkeypatch, model, resident, "LONGSTRAW_DECODE_GDN", "conv_gdn",
                                conv_gdn_decode_triton, sum(not layer.is_attention for layer in model.model.layers),
                                3, 1e-5, capacity=8)
    fused = model.decoder(resident, 2, 8)
    assert all(state.conv_BXW is None and state.conv_BXR.shape[-1] == model.config.linear_conv_kernel_dim
               for state in fused.layers if hasattr(state, "conv_BXR"))
    assert_compiled_step_equals_eager(model.decoder(resident, 2, 8), model.decoder(resident, 2, 8), steps=2)
