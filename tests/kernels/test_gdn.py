"""GDN torch reference: chunked vs recurrent (outputs, state, every gradient), parity with Hugging Face's torch
path, span splitting with the state carried (what blockwise prompt capture relies on), dtypes and T = 0."""

import functools

import pytest
import torch

from conftest import gdn_inputs, rel_err
from longstraw_kernels.gdn.reference import gdn_chunked, gdn_recurrent

B, H, K, V = 2, 2, 8, 6


pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(T, G, dtype=torch.float64, with_state=True, seed=0):
    """`gdn_inputs` at this file's B, H, K, V in `dtype`; all leaves require grad."""
    inputs = gdn_inputs(B, T, H, G, K, V, with_state=with_state, seed=seed)
    return {name: None if t is None else t.to(dtype).requires_grad_() for name, t in inputs.items()}


def run(fn, x, **kwargs):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], **kwargs)


def leaves(x):
    return [t for t in x.values() if t is not None]


def loss_of(o_BTGV, state_BGKV, seed=1):
    """A loss with random cotangents on both outputs, so no gradient path is trivially zero."""
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o_BTGV.shape, generator=gen, dtype=torch.float64).to(o_BTGV.dtype)
    ds = torch.randn(state_BGKV.shape, generator=gen, dtype=torch.float64).to(state_BGKV.dtype)
    return (o_BTGV * do).sum() + (state_BGKV * ds).sum()


@functools.cache
def recurrent_fp64(T, group, with_state):
    """Outputs and gradients of the recurrent form, shared by both chunk sizes to keep the suite fast."""
    x = make_inputs(T, G=H * group, with_state=with_state, seed=T * 10 + group)
    o, s = run(gdn_recurrent, x)
    grads = torch.autograd.grad(loss_of(o, s), leaves(x))
    return o.detach(), s.detach(), grads


@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 130])
def test_chunked_matches_recurrent_fp64(T, chunk_size, group, with_state):
    o_ref, s_ref, grads_ref = recurrent_fp64(T, group, with_state)
    x = make_inputs(T, G=H * group, with_state=with_state, seed=T * 10 + group)
    o, s = run(gdn_chunked, x, chunk_size=chunk_size)
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(s, s_ref) < 1e-10

    grads = torch.autograd.grad(loss_of(o, s), leaves(x))
    for name, dx, dx_ref in zip([n for n, t in x.items() if t is not None], grads, grads_ref):
        if name == "g" and T == 1 and not with_state:
            # Decaying the zero initial state does nothing, so this gradient is exactly zero.
            assert dx.abs().max() < 1e-12 and not dx_ref.any()
            continue
        assert rel_err(dx, dx_ref) < 1e-10, name


def test_explicit_scale_fp64():
    x = make_inputs(T=40, G=2 * H, seed=5)
    o_ref, s_ref = run(gdn_recurrent, x, scale=0.3)
    o, s = run(gdn_chunked, x, scale=0.3, chunk_size=16)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10
    o_default, _ = run(gdn_recurrent, x)
    assert rel_err(o_default, o_ref) > 1e-3


@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("T", [1, 65, 130])
def test_matches_transformers_fp32(T, group, with_state):
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    x = make_inputs(T, G=H * group, dtype=torch.float32, with_state=with_state, seed=T + group)
    hf_kwargs = dict(g=x["g"], beta=x["beta"], initial_state=x["state"], output_final_state=True,
                     use_qk_l2norm_in_kernel=False)
    with torch.no_grad():
        o_hf_rec, s_hf_rec = hf.torch_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], **hf_kwargs)
        o_hf_chunk, s_hf_chunk = hf.torch_chunk_gated_delta_rule(x["q"], x["k"], x["v"], chunk_size=64, **hf_kwargs)
        o_rec, s_rec = run(gdn_recurrent, x)
        o_chunk, s_chunk = run(gdn_chunked, x, chunk_size=64)
    for o, s in [(o_rec, s_rec), (o_chunk, s_chunk)]:
        for o_hf, s_hf in [(o_hf_rec, s_hf_rec), (o_hf_chunk, s_hf_chunk)]:
            assert rel_err(o, o_hf) < 1e-5
            assert rel_err(s, s_hf) < 1e-5


@pytest.mark.parametrize("fn", [gdn_recurrent, gdn_chunked])
@pytest.mark.parametrize("split", [1, 37, 64])
def test_two_spans_with_carried_state_match_one_span(fn, split):
    T = 100
    x = make_inputs(T, G=2 * H, seed=split)
    kwargs = {"chunk_size": 16} if fn is gdn_chunked else {}
    o_full, s_full = run(fn, x, **kwargs)
    grads_full = torch.autograd.grad(loss_of(o_full, s_full), leaves(x))

    first = {n: t[:, :split] for n, t in x.items() if n != "state"} | {"state": x["state"]}
    o_1, s_1 = run(fn, first, **kwargs)
    # Capture-style replay: span 2 starts from a detached copy of span 1's state, and the gradient that reaches
    # that state is pushed back through span 1 afterwards.
    mid_state = s_1.detach().requires_grad_()
    second = {n: t[:, split:] for n, t in x.items() if n != "state"} | {"state": mid_state}
    o_2, s_2 = run(fn, second, **kwargs)
    assert rel_err(torch.cat([o_1, o_2], dim=1), o_full) < 1e-12
    assert rel_err(s_2, s_full) < 1e-12

    # The full loss split into its span-2 part and its span-1 part (fixed cotangents, so the parts add up).
    loss_2 = loss_of(torch.cat([o_1.detach(), o_2], dim=1), s_2)
    grads_2 = torch.autograd.grad(loss_2, leaves(x) + [mid_state], allow_unused=True)
    d_mid_state = grads_2[-1]
    loss_1 = loss_of(torch.cat([o_1, o_2.detach()], dim=1), s_2.detach()) + (s_1 * d_mid_state).sum()
    grads_1 = torch.autograd.grad(loss_1, leaves(x), allow_unused=True)
    names = [n for n, t in x.items() if t is not None]
    for name, d1, d2, d_ref in zip(names, grads_1, grads_2[:-1], grads_full):
        d = d1 if d2 is None else d1 + d2
        assert rel_err(d, d_ref) < 1e-12, name


@pytest.mark.parametrize("fn", [gdn_recurrent, gdn_chunked])
@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float64, torch.float64)])
def test_dtypes(fn, dtype, state_dtype):
    x = make_inputs(T=20, G=2 * H, dtype=dtype, with_state=False)
    o, s = run(fn, x)
    assert o.dtype == dtype and s.dtype == state_dtype
    loss_of(o, s).backward()
    assert all(t.grad is not None and t.grad.dtype == dtype for t in leaves(x))


@pytest.mark.parametrize("fn", [gdn_recurrent, gdn_chunked])
@pytest.mark.parametrize("with_state", [True, False])
def test_empty_sequence(fn, with_state):
    x = make_inputs(T=0, G=2 * H, dtype=torch.float32, with_state=with_state)
    o, s = run(fn, x)
    assert o.shape == (B, 0, 2 * H, V) and o.dtype == torch.float32
    assert s.shape == (B, 2 * H, K, V) and s.dtype == torch.float32
    if with_state:
        assert torch.equal(s, x["state"])
        s.sum().backward()
        assert torch.equal(x["state"].grad, torch.ones_like(x["state"]))
    else:
        assert not s.any()


def test_rejects_bad_head_counts():
    x = make_inputs(T=4, G=3, with_state=False)
    with pytest.raises(ValueError, match="multiple of key heads"):
        run(gdn_chunked, x)
