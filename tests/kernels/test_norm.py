"""The norms and gates (`longstraw_kernels/norm`): each Triton kernel, forward and backward, against its torch
reference (Triton's interpreter on CPU, the GPU under `-m gpu`), on awkward row counts and lengths and on rows read
in place from a wider tensor, and the dispatch: the references off CUDA, under kernels.norm=torch and for operands
not read in place (said once), and each family's MLP gate."""

import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from longstraw_kernels import at_least_fp32, use_kernels
from longstraw_kernels.gdn.reference import l2norm
from longstraw_kernels.linear.reference import gated_rms_norm, rms_norm_one_plus, silu_mul_reference
from longstraw_kernels.norm import triton_norm

# Triton's interpreter rounds fp32 to bf16 toward zero (tests/kernels/test_decode_linear.py): within a unit in the
# last place of bf16 where the references round to nearest; fp32 differs by the order of a row's sum only
BOUND = {torch.bfloat16: 2**-7, torch.float32: 1e-6}


def rows(R, N, dtype, seed, wide=1):
    """[R, N] rows; with wide > 1 a view of the first N of every wide * N (each row beside others, as qwen36's query
    heads sit beside their gates in q_proj's output)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, wide * N, generator=g) * 3).to(dtype)
    return x[:, :N]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R, N, wide", [(63, 1000, 1), (5, 256, 2), (130, 16, 1)])
def test_rms_norm_equals_its_reference(dtype, R, N, wide):
    x = rows(R, N, dtype, R, wide)
    g = (torch.randn(N, generator=torch.Generator().manual_seed(1)) * 0.3).to(dtype)
    got = triton_norm.rms_norm(x, g, 1e-6)
    assert got.dtype == dtype and got.is_contiguous()
    assert rel_err(got, rms_norm_one_plus(x, g, 1e-6)) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R, N", [(63, 128), (7, 100)])
def test_gated_norm_equals_its_reference(dtype, R, N):
    x, z = rows(R, N, dtype, 2), rows(R, N, dtype, 3, wide=3)
    w = (1 + torch.randn(N, generator=torch.Generator().manual_seed(4)) * 0.3).to(dtype)
    got = triton_norm.gated_norm(x.reshape(R, 1, N), z.reshape(R, 1, N), w, 1e-6)
    assert got.shape == (R, 1, N) and got.dtype == dtype
    # three roundings to bf16 on the way
    assert rel_err(got, gated_rms_norm(x, z, w, 1e-6).reshape(R, 1, N)) < 2 * BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_l2norm_equals_its_reference(dtype):
    # GDN's q: heads of 24 read in place from the conv's output, two key heads beside a value head
    conv = rows(37, 3 * 2 * 24, dtype, 5)
    q = conv[:, : 2 * 24].reshape(37, 2, 24)
    got = triton_norm.l2norm_fp32(q)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert rel_err(got, l2norm(at_least_fp32(q))) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_equals_its_reference(dtype):
    gate, up = rows(3, 4097, dtype, 6).contiguous(), rows(3, 4097, dtype, 7).contiguous()
    got = triton_norm.silu_mul(gate, up)
    assert rel_err(got, F.silu(gate) * up) < 2 * BOUND[dtype]


def _grad_case(name, dtype):
    """(the entry, its reference, the inputs, which of them are leaves) for the backward tests: the entry reads x
    as a view of a wider tensor where the model does (the query heads beside their gates, GDN's key heads in the
    conv's output); a weight is a leaf or not (LoRA freezes it)."""
    gen = torch.Generator().manual_seed(11)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    if name in ("rms", "rms_frozen"):
        args = [randn(37, 2, 192, scale=3), randn(96, scale=0.3)]
        return (lambda x, g: triton_norm.rms_norm(x[..., :96], g, 1e-6),
                lambda x, g: rms_norm_one_plus(x[..., :96], g, 1e-6), args, [True, name == "rms"])
    if name == "gated":
        args = [randn(37, 4, 64, scale=2), randn(37, 4, 64), randn(64, scale=0.3) + 1]
        return (lambda x, z, w: triton_norm.gated_norm(x, z, w, 1e-6), lambda x, z, w: gated_rms_norm(x, z, w, 1e-6),
                args, [True, True, True])
    if name == "l2":
        def heads(conv):  # GDN's key heads in the conv's output
            return conv[:, :48].reshape(37, 2, 24)

        return (lambda c: triton_norm.l2norm_fp32(heads(c)), lambda c: l2norm(heads(c)), [randn(37, 3 * 48)],
                [True])
    return triton_norm.silu_mul, lambda a, b: F.silu(a) * b, [randn(3, 1000, scale=2), randn(3, 1000)], [True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["rms", "rms_frozen", "gated", "l2", "silu_mul"])
def test_backward_equals_the_fp64_reference(name, dtype):
    """Each entry, where an input requires grad, records its backward kernel: the outputs and every leaf's gradient
    against the reference's graph in fp64 (fp32 to its sum order; bf16 to its roundings, toward zero in the
    interpreter); a weight that is not a leaf gets no gradient."""
    fn, reference, args, leaves = _grad_case(name, dtype)
    got_in = [a.clone().requires_grad_(leaf) for a, leaf in zip(args, leaves)]
    want_in = [a.double().requires_grad_(leaf) for a, leaf in zip(args, leaves)]
    got, want = fn(*got_in), reference(*want_in)
    assert isinstance(got.grad_fn, torch.autograd.function.BackwardCFunction)  # the kernel's, not torch's chain
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got.backward(dy.to(got.dtype))
    want.backward(dy)
    bound = 1e-6 if dtype == torch.float32 else 2**-6
    assert rel_err(got, want) < bound
    for a, b, leaf in zip(got_in, want_in, leaves):
        assert (a.grad is None) == (not leaf)
        if leaf:
            assert a.grad.dtype == a.dtype and rel_err(a.grad, b.grad) < bound, (name, rel_err(a.grad, b.grad))


def test_rows_of_reads_heads_in_place():
    x = torch.zeros(2, 4, 6, 8)
    assert triton_norm.rows_of(x).shape == (8, 6, 8)
    assert triton_norm.rows_of(x[..., :4]).stride() == (48, 8, 1)
    assert triton_norm.rows_of(x[:, :, :3]).stride() == (48, 8, 1)  # heads of a wider tensor
    assert triton_norm.rows_of(x[:, :3]) is None  # the dims before the heads of two strides
    assert triton_norm.rows_of(x.transpose(2, 3)) is None  # the last dim strided
    assert triton_norm.rows_of(torch.zeros(5)).shape == (1, 1, 5)


def test_off_cuda_the_references_run_with_their_gradients():
    """On CPU every function is its reference, bit for bit, gradients included."""
    from longstraw_kernels import norm

    x = torch.randn(5, 32, requires_grad=True)
    g = torch.randn(32) * 0.1
    norm.rms_norm(x, g, 1e-6).sum().backward()
    want = x.grad.clone()
    x.grad = None
    rms_norm_one_plus(x, g, 1e-6).sum().backward()
    assert torch.equal(x.grad, want)
    assert torch.equal(norm.silu_mul(x, x), F.silu(x) * x)
    assert torch.equal(norm.l2norm_fp32(x), l2norm(x))


def test_operands_not_read_in_place_take_the_reference_and_are_said_once(caplog):
    """Rows of a strided last dim (a transposed view), or a weight that is not one
    contiguous row, keep the reference: said once, with the operand's layout."""
    from longstraw_kernels import norm, say_once

    x, g = torch.zeros(4, 6, 8), torch.zeros(8)
    say_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="longstraw_kernels"):
        assert norm._read_in_place(triton_norm, (x, g))
        assert norm._read_in_place(triton_norm, (x[:, :, :4], g[:4]))  # rows of a wider tensor
        for _ in range(2):
            assert not norm._read_in_place(triton_norm, (x.transpose(1, 2), g[:6]))
        assert not norm._read_in_place(triton_norm, (x, torch.zeros(16)[::2]))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "shape (4, 8, 6), strides (48, 1, 8)" in said[0], said


def test_silu_mul_of_views_not_contiguous_takes_the_reference_and_says_so_once(monkeypatch, caplog):
    """The gate's launch reads its operands flat: the halves of one GEMM's output take the reference, said once
    with the layout; contiguous ones the launch (its dispatch made to serve on CPU)."""
    from longstraw_kernels import norm, say_once

    launched = []
    # the dispatch as on CUDA, its layout rule included
    monkeypatch.setattr(norm, "_kernels",
                        lambda *t, flat=False: triton_norm if norm._read_in_place(triton_norm, t, flat) else None)
    monkeypatch.setattr(triton_norm, "silu_mul", lambda g, u: launched.append(1) or silu_mul_reference(g, u))
    gate_up = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    gate, up = gate_up.chunk(2, dim=-1)
    say_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="longstraw_kernels"):
        for _ in range(2):
            assert torch.equal(norm.silu_mul(gate, up), silu_mul_reference(gate, up)) and not launched
        norm.silu_mul(gate.contiguous(), up.contiguous())
    assert launched == [1]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "shape (4, 8), strides (16, 1)" in said[0], said


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_at_qwen36_minis_shapes(monkeypatch, caplog):
    """bf16 at qwen36_mini's shapes on the GPU (rounding to nearest there): the hidden norm, the query heads' norm
    read in place beside their gates, GDN's gated norm and q / k norm, the MLP's SiLU(gate) * up; each taken by
    the dispatch under no_grad and where a graph is recorded (its gradients against fp64's), and not under
    kernels.norm=torch."""
    from longstraw_kernels import norm

    calls = []
    for name in ("rms_norm", "gated_norm", "l2norm_fp32", "silu_mul"):
        fn = getattr(triton_norm, name)
        monkeypatch.setattr(triton_norm, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    gen = torch.Generator("cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    T, eps = 4096, 1e-6
    x, g = randn(1, T, 2048, scale=3), randn(2048, scale=0.3)
    q = randn(1, T, 16, 512)[..., :256]
    z, o, w = randn(1, T, 16, 128), randn(1, T, 16, 128), randn(128, scale=0.3) + 1
    conv = randn(1, T, 4096)
    gate, up = randn(1, T, 6144, scale=2), randn(1, T, 6144)
    cases = [
        (norm.rms_norm, (x, g, eps), rms_norm_one_plus),
        (norm.rms_norm, (q, g[:256], eps), rms_norm_one_plus),
        (norm.gated_norm, (o, z, w, eps), gated_rms_norm),
        (norm.l2norm_fp32, (conv[..., :1024].unflatten(-1, (8, 128)),), lambda t: l2norm(at_least_fp32(t))),
        (norm.silu_mul, (gate, up), lambda a, b: F.silu(a) * b),
    ]
    with torch.no_grad():
        for fn, args, reference in cases:
            got, want = fn(*args), reference(*args)
            # the same roundings to nearest; a row's sum in another order moves a last bit (of bf16 rarely)
            assert rel_err(got, want) < (1e-6 if got.dtype == torch.float32 else 2**-9), fn.__name__
            if got.dtype == torch.bfloat16:
                assert (got != want).float().mean() < 0.01, fn.__name__
    assert calls == ["rms_norm", "rms_norm", "gated_norm", "l2norm_fp32", "silu_mul"]
    calls.clear()

    def graph(fn, args, dtype):
        """The output and every input's gradient of fn over leaves of `dtype` (the same dy each time)."""
        leaves = [a.detach().to(dtype).requires_grad_() if torch.is_tensor(a) else a for a in args]
        out = fn(*leaves)
        dy = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        out.backward(dy.to(torch.bfloat16).to(out.dtype))
        return [out] + [a.grad for a in leaves if torch.is_tensor(a)]

    for fn, args, _ in cases:
        # where a graph is recorded: the backward kernel, each gradient in fp32 rounded once, against fp64's graph
        got, want = graph(fn, args, torch.bfloat16), graph(fn, args, torch.float64)
        for i, (a, b) in enumerate(zip(got, want)):
            assert rel_err(a, b) < 2**-8, (fn.__name__, i, rel_err(a, b))
    assert calls == ["rms_norm", "rms_norm", "gated_norm", "l2norm_fp32", "silu_mul"]
    calls.clear()
    # a replay's GDN q / k: transposed views of torch's conv, the reference's, unsaid
    from longstraw_kernels import say_once

    say_once.cache_clear()
    conv_t = randn(1, 1024, 4096).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    with caplog.at_level(logging.WARNING, logger="longstraw_kernels"):
        norm.l2norm_fp32(conv_t[..., :1024].unflatten(-1, (8, 128))).sum().backward()
    assert not calls and not caplog.records and conv_t.grad is not None
    with torch.no_grad(), use_kernels(norm="torch"):
        assert torch.equal(norm.rms_norm(x, g, eps), rms_norm_one_plus(x, g, eps)) and not calls


def test_qwen36s_mlp_gate_takes_the_launch_glm52s_torchs_kernels():
    """qwen36's MLP computes SiLU(gate) * up through kernels.norm (with its norms, a win in its capture); glm52's
    (the dense layer, the shared experts) through torch's two kernels: there the launch measured slower in the
    capture and the replay (docs/BENCHMARKS.md, variants)."""
    from longstraw_cli.models import build_model
    from longstraw_cli.models.core import MLP
    from longstraw_kernels import norm

    gates = {name: {m.silu_mul for m in build_model(name, dtype=torch.float32, device="cpu", seed=0).modules()
                    if isinstance(m, MLP)} for name in ("qwen36_tiny", "glm52_tiny")}
    assert gates == {"qwen36_tiny": {norm.silu_mul}, "glm52_tiny": {silu_mul_reference}}
