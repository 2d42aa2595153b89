"""The decode step's fused linear (`linear/triton_skinny.py`, Triton's interpreter on CPU) against its torch
reference, which is the model's modules called one after another: the norm, the linear, silu(gate) * up, the
residual add; rows and columns that are not multiples of the blocks, K walked in several steps with a ragged
last one, strided rows. On CUDA, tests/kernels/test_gpu.py checks it at qwen36_mini's shapes in bf16."""

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from longstraw_cli.models.qwen36.model import RMSNorm
from longstraw_kernels.linear import decode_linear, decode_linear_reference
from longstraw_kernels.linear.triton_skinny import PREFETCH, decode_linear_triton, launch_config

# small blocks, so that a few columns and 80 inputs take several programs and three K steps; K in one part, or
# split into two and three parts (the counted, last-part reduction), the last of them ragged or empty of steps
SMALL = (16, 32, 4, 1, 1)
SPLITS = [SMALL, (16, 32, 4, 1, 2), (16, 32, 4, 1, 3)]


def operands(M, N, K, dtype, glu=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(M, K + 7, generator=g).to(dtype)
    x = rows[:, 3:K + 3]  # strided rows, as a split leaves them
    weight = (torch.randn(2 * N if glu else N, K, generator=g) / K**0.5).to(dtype)
    norm = (torch.randn(K, generator=g) * 0.3).to(dtype)
    residual = torch.randn(M, N, generator=g).to(dtype)
    # glu: the gate's and the up's weights, two views of one (as a concatenated weight gives them) or two tensors
    return x, (weight[:N], weight[N:]) if glu else (weight, None), norm, residual


# bf16 against the fp64 oracle: the interpreter rounds fp32 to bf16 toward zero (one unit in the last place, twice
# what a GPU's round-to-nearest costs), so its bf16 outputs are up to ~2% off where the reference's are ~0.5%
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("M, N, K", [(1, 16, 80), (3, 40, 80), (8, 33, 64), (17, 20, 96)])
@pytest.mark.parametrize("norm, glu, residual", [(False, False, False), (True, False, False), (True, True, False),
                                                 (False, False, True), (True, True, True)])
@pytest.mark.parametrize("config", SPLITS, ids=lambda c: f"split{c[-1]}")
def test_kernel_equals_the_reference(dtype, bound, M, N, K, norm, glu, residual, config):
    x, (weight, up), norm_K, residual_MN = operands(M, N, K, dtype, glu)
    if up is not None and M % 2:  # odd M: the up's weight a tensor of its own, not a view beside the gate's
        up = up.clone()
    kwargs = dict(up_NK=up, norm_K=norm_K if norm else None, eps=1e-6)
    got = decode_linear_triton(x, weight, **kwargs, residual=residual_MN if residual else None, config=config)
    if dtype == torch.bfloat16:
        x, weight, norm_K, residual_MN = (t.double() for t in (x, weight, norm_K, residual_MN))
        kwargs.update(up_NK=None if up is None else up.double(), norm_K=norm_K if norm else None)
    want = decode_linear_reference(x, weight, **kwargs, residual_MN=residual_MN if residual else None)
    assert got.dtype == dtype and got.shape == (M, N)
    assert rel_err(got, want) < bound


def test_the_default_launch_and_a_row_batch_shape():
    """[B, 1, K] in, [B, 1, N] out; the default blocks (K = 300: a ragged last K step)."""
    x, (weight, up), norm_K, residual = operands(8, 50, 300, torch.float32, glu=True)
    x_B1K = x.contiguous()[:, None]
    got = decode_linear_triton(x_B1K, weight, up_NK=up, norm_K=norm_K, residual=residual[:, None])
    want = decode_linear_reference(x_B1K, weight, up_NK=up, norm_K=norm_K, residual_MN=residual[:, None])
    assert got.shape == (8, 1, 50) and rel_err(got, want) < 2e-6
    assert 300 % launch_config(8, 50, 300, glu=True)[1]


def test_a_config_may_leave_out_split_and_prefetch(monkeypatch):
    """A launch config of four values (blocks, warps, stages) launches one part of K and the default prefetch, as
    launch_config's own tuples have them; one of five values, the default prefetch."""
    from longstraw_kernels.linear import triton_skinny

    launched = []
    launch = triton_skinny._launch

    def spy(*args, **kwargs):
        launched.append(args[-2:])  # (split, prefetch)
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_skinny, "_launch", spy)
    x, (weight, _), norm_K, residual = operands(3, 40, 80, torch.float32)
    kwargs = dict(norm_K=norm_K, residual=residual)
    whole = decode_linear_triton(x, weight, **kwargs, config=(*SMALL, PREFETCH))
    assert torch.equal(decode_linear_triton(x, weight, **kwargs, config=SMALL[:4]), whole)
    assert torch.equal(decode_linear_triton(x, weight, **kwargs, config=(*SMALL[:4], 3)), decode_linear_triton(
        x, weight, **kwargs, config=(*SMALL[:4], 3, 0)))
    assert launched == [(1, PREFETCH), (1, PREFETCH), (3, PREFETCH), (3, 0)]


def test_the_reference_is_the_modules_one_after_another():
    """fp64: the model's RMSNorm, the linear, silu * up, + residual, each a module or op of its own."""
    x, (weight, up), norm_K, residual = operands(5, 12, 32, torch.float64, glu=True)
    module = RMSNorm(32, eps=1e-6).double()
    module.weight.data.copy_(norm_K)
    h = module(x)
    want = residual + F.silu(F.linear(h, weight)) * F.linear(h, up)
    got = decode_linear_reference(x, weight, up_NK=up, norm_K=norm_K, eps=1e-6, residual_MN=residual)
    assert torch.equal(got, want)


def test_cpu_tensors_take_the_reference():
    x, (weight, _), norm_K, residual = operands(4, 10, 24, torch.float32)
    got = decode_linear(x, weight, norm_K=norm_K, residual=residual)
    assert torch.equal(got, decode_linear_reference(x, weight, norm_K=norm_K, residual_MN=residual))


def test_rows_strided_in_k_are_read_right():
    """An input whose K is not its unit-stride axis (a transposed view) and a strided residual: copied first."""
    x, (weight, _), norm_K, residual = operands(6, 24, 40, torch.float32)
    x_t = x.t().contiguous().t()
    res_t = residual.t().contiguous().t()
    assert x_t.stride(-1) != 1 and res_t.stride(-1) != 1
    got = decode_linear_triton(x_t, weight, norm_K=norm_K, residual=res_t, config=SMALL)
    assert rel_err(got, decode_linear_reference(x, weight, norm_K=norm_K, residual_MN=residual)) < 2e-6


def test_a_cuda_input_the_kernel_refuses_is_said_once(monkeypatch, caplog):
    """On CUDA with Triton, an input the kernel does not take (here: more rows than MAX_ROWS) leaves the decode to
    the modules, and says so once; torch chosen (or no Triton) says nothing here (the run's start does)."""
    import types

    from longstraw_kernels import linear
    from longstraw_kernels.linear import triton_skinny

    x = types.SimpleNamespace(is_cuda=True, shape=(32, 1, 64), dtype=torch.bfloat16, numel=lambda: 32 * 64)
    weight = torch.zeros(16, 64, dtype=torch.bfloat16)
    module = types.SimpleNamespace(supported=lambda x, *w: False, MAX_ROWS=triton_skinny.MAX_ROWS,
                                   decode_linear_triton=triton_skinny.decode_linear_triton)
    monkeypatch.setattr(linear, "kernel_module", lambda: module)
    linear._say_the_modules_run.cache_clear()
    with caplog.at_level("WARNING", logger="longstraw_kernels.linear"):
        assert linear.kernel_entry(x, weight) is None
        assert linear.kernel_entry(x, weight) is None
    said = [r.getMessage() for r in caplog.records if "decode linear kernel" in r.getMessage()]
    assert len(said) == 1 and "32 rows" in said[0] and "at most 16 rows" in said[0]
    module.supported = lambda x, *w: True
    assert linear.kernel_entry(x, weight) is triton_skinny.decode_linear_triton
    monkeypatch.setattr(linear, "kernel_module", lambda: None)
    caplog.clear()
    assert linear.kernel_entry(x, weight) is None and not caplog.records


def test_split_launches_leave_their_counts_at_zero():
    """The K parts' counters are shared by every launch on a device: each split launch sets its tiles' back to 0, so
    the next launch (or a CUDA graph's next replay) reduces as the first did, bit for bit."""
    from longstraw_kernels.linear import triton_skinny

    x, (weight, up), norm_K, residual = operands(5, 40, 96, torch.float32, glu=True)
    kwargs = dict(up_NK=up, norm_K=norm_K, residual=residual, config=SPLITS[-1])
    first = decode_linear_triton(x, weight, **kwargs)
    assert not triton_skinny._COUNTS[x.device].any()
    assert torch.equal(decode_linear_triton(x, weight, **kwargs), first)
    assert rel_err(first, decode_linear_reference(x, weight, up_NK=up, norm_K=norm_K, residual_MN=residual)) < 2e-6


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("M, N, K", [(1, 16, 64), (3, 40, 80), (8, 33, 96)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("config", SPLITS, ids=lambda c: f"split{c[-1]}")
def test_gated_norm_prologue_equals_the_reference(dtype, bound, M, N, K, residual, config):
    """GDN's output norm (each head of 16 features normalised, scaled by w, times silu(z)) in the prologue of its
    output linear, one head a K step; z's rows strided, as a split of the input linears' product leaves them."""
    x, (weight, _), _, residual_MN = operands(M, N, K, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    z = torch.randn(M, 2 * K, generator=g).to(dtype)[:, K // 2:K // 2 + K]
    w = (1 + 0.3 * torch.randn(16, generator=g)).to(dtype)
    got = decode_linear_triton(x, weight, gate=z, gate_norm_V=w, residual=residual_MN if residual else None,
                               config=config)
    wide = (lambda t: t.double()) if dtype == torch.bfloat16 else (lambda t: t)
    want = decode_linear_reference(wide(x), wide(weight), gate_MK=wide(z), gate_norm_V=wide(w),
                                   residual_MN=wide(residual_MN) if residual else None)
    assert got.dtype == dtype and got.shape == (M, N)
    assert rel_err(got, want) < bound


def test_the_gated_reference_is_the_models_norm_then_the_linear():
    """fp64: qwen36's GatedRMSNorm over [M, heads, V], heads joined, then the linear and the residual."""
    from longstraw_cli.models.qwen36.model import GatedRMSNorm

    x, (weight, _), _, residual = operands(4, 12, 64, torch.float64)
    z = torch.randn(4, 64, dtype=torch.float64)
    module = GatedRMSNorm(16, eps=1e-6).double()
    module.weight.data.normal_()
    want = residual + F.linear(module(x.reshape(4, 4, 16), z.reshape(4, 4, 16)).reshape(4, 64), weight)
    got = decode_linear_reference(x, weight, gate_MK=z, gate_norm_V=module.weight.data, eps=1e-6, residual_MN=residual)
    assert torch.equal(got, want)


def test_a_gated_norm_the_kernel_does_not_take_is_refused():
    x, (weight, _), norm_K, _ = operands(2, 8, 48, torch.float32)
    z = torch.randn(2, 48)
    with pytest.raises(ValueError, match="gated norm"):  # heads of 24: not a power of two
        decode_linear_triton(x, weight, gate=z, gate_norm_V=torch.ones(24))
    with pytest.raises(ValueError, match="gated norm"):  # beside the input norm
        decode_linear_triton(x, weight, gate=z, gate_norm_V=torch.ones(16), norm_K=norm_K)
    with pytest.raises(ValueError, match="gated norm"):
        decode_linear_reference(x, weight, gate_MK=z)


def test_the_dispatch_takes_the_gated_norm_to_the_reference_on_cpu():
    x, (weight, _), _, residual = operands(3, 10, 32, torch.float32)
    z, w = torch.randn(3, 32), torch.randn(16)
    got = decode_linear(x, weight, gate=z, gate_norm_V=w, residual=residual)
    assert torch.equal(got, decode_linear_reference(x, weight, gate_MK=z, gate_norm_V=w, residual_MN=residual))


def test_a_gated_norm_the_kernel_does_not_take_is_said_once(monkeypatch, caplog):
    """Where the kernel runs but not the gated norm (heads of 24 here), the decoder runs the norm apart and says so
    once; torch chosen says nothing here."""
    from longstraw_kernels import linear
    from longstraw_kernels.linear import triton_skinny

    monkeypatch.setattr(linear, "kernel_module", lambda: triton_skinny)
    linear._say_the_gated_norm_runs_apart.cache_clear()
    with caplog.at_level("WARNING", logger="longstraw_kernels.linear"):
        assert not linear.gate_serves(96, torch.ones(24, dtype=torch.bfloat16), torch.bfloat16)
        assert not linear.gate_serves(96, torch.ones(24, dtype=torch.bfloat16), torch.bfloat16)
        assert linear.gate_serves(96, torch.ones(16, dtype=torch.bfloat16), torch.bfloat16)
    said = [r.getMessage() for r in caplog.records if "gated norm" in r.getMessage()]
    assert len(said) == 1 and "heads of 24" in said[0]
    monkeypatch.setattr(linear, "kernel_module", lambda: None)
    caplog.clear()
    assert not linear.gate_serves(96, torch.ones(16), torch.float32) and not caplog.records


def test_programmatic_launch_is_for_cuda_sm90(monkeypatch):
    """`programmatic_launch`: CUDA of compute capability 9.0 or more, not under Triton's interpreter; decided once
    per device."""
    from longstraw_kernels.linear import triton_skinny

    cuda = torch.device("cuda", 0)

    def decided(capability=(9, 0), interpreted=False):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        if interpreted:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        triton_skinny.programmatic_launch.cache_clear()
        return triton_skinny.programmatic_launch(cuda)

    try:
        assert decided() and decided(capability=(10, 0))
        assert not decided(capability=(8, 0)) and not decided(interpreted=True)
        assert not triton_skinny.programmatic_launch(torch.device("cpu"))
    finally:
        monkeypatch.undo()
        triton_skinny.programmatic_launch.cache_clear()
