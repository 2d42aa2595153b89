"""The end of the qwen36 decode's attention in one launch (`triton_decode_merge.decode_merge`, Triton's interpreter
on CPU): its contract (`decode_merge_reference`) is the cascade's merges and the gate, and the kernel computes it.
Not yet run on a GPU."""

import pytest
import torch

from conftest import assert_decodes_alike, ids, random_model, rel_err
from longstraw_kernels.attention.decode import (
    cascade_decode_attention,
    decode_pages_partials,
    response_partials_torch,
)
from longstraw_kernels.attention.triton_decode_merge import decode_merge, decode_merge_reference


def partials(B, Q, K, D, N_P, N_R, dtype, seed, empty_pages=0, empty_slots=0):
    g = torch.Generator().manual_seed(seed)
    M = B * Q // K
    out_p = torch.randn(N_P, M, K, D, generator=g).to(dtype).transpose(1, 2)  # strided, as the varlen form gives
    lse_p = (torch.randn(N_P, K, M, generator=g) * 3).float()
    out_r = torch.randn(N_R, B, Q, D, generator=g)
    lse_r = torch.randn(N_R, B, Q, generator=g) * 3
    lse_p[N_P - empty_pages:] = float("-inf")
    lse_r[N_R - empty_slots:] = float("-inf")
    out_r[N_R - empty_slots:] = 0.0
    gate = torch.randn(B, Q, 2 * D, generator=g).to(dtype)[..., D:]  # a view, as the query GEMM's gate
    return out_p, lse_p, out_r, lse_r, gate


def test_contract_is_the_cascade_and_the_gate():
    """fp64: the reference's two merges are `cascade_decode_attention`'s (pages, then the response's filled slots)
    times sigmoid(gate)."""
    B, Q, K, D, P, S, filled = 2, 4, 2, 8, 300, 9, 5
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((B, Q, D), (P, K, D), (P, K, D)))
    k_r, v_r = (torch.randn(B, S, K, D, generator=g, dtype=torch.float64) for _ in range(2))
    gate = torch.randn(B, Q, D, generator=g, dtype=torch.float64)
    out_p, lse_p = decode_pages_partials(q, k, v, scale=0.3, num_splits=4)
    out_r, lse_r = response_partials_torch(q, k_r, v_r, torch.tensor([filled]), scale=0.3)
    want = cascade_decode_attention(q, k, v, k_r, v_r, torch.tensor([filled]), scale=0.3) * torch.sigmoid(gate)
    assert rel_err(decode_merge_reference(out_p, lse_p, out_r, lse_r, gate.float()).double(), want) < 1e-6


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")  # the interpreter's log2(0)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, Q, K, D, N_P, N_R, empty_pages, empty_slots", [
    (2, 4, 2, 32, 5, 3, 0, 1),      # a range of slots past the filled ones
    (1, 8, 2, 16, 20, 17, 3, 16),   # more partials than a chunk; one filled range; empty page ranges
    (2, 2, 1, 16, 1, 2, 1, 2),      # nothing at all: zeros
])
def test_kernel_equals_its_contract(dtype, B, Q, K, D, N_P, N_R, empty_pages, empty_slots):
    args = partials(B, Q, K, D, N_P, N_R, dtype, seed=N_P * N_R, empty_pages=empty_pages, empty_slots=empty_slots)
    want, got = decode_merge_reference(*args), decode_merge(*args)
    assert got.shape == (B, Q, D) and got.dtype == dtype
    if empty_pages == N_P and empty_slots == N_R:
        assert torch.equal(got, torch.zeros_like(got)) and torch.equal(want, got)
        return
    # the same three roundings: fp16 to nearest (as a GPU rounds), within a quarter of a unit in the last place
    # (RMS); the interpreter truncates to bf16 (tests/kernels/test_decode_qk.py), three times: 1.0-1.3 units measured
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert rel_err(got.double(), want.double()) < (2 * ulp if dtype == torch.bfloat16 else ulp / 4)


@torch.no_grad()
@pytest.mark.parametrize("varlen", [False, True])
def test_qwen36_decode_through_the_fused_merge_equals_the_modules(monkeypatch, varlen):
    """LONGSTRAW_DECODE_MERGE=fused: each attention layer's merges and gate through the kernel (Triton's interpreter
    here), with the modules' logits over 3 steps in bf16, with the fused q / k too; a layer whose pages hook is
    swapped keeps the modules' merge; another value is refused."""
    import functools

    from longstraw_kernels.attention.decode import decode_pages_attention
    from longstraw_kernels.attention.triton_decode_merge import decode_merge as kernel

    model = random_model("qwen36_tiny", torch.bfloat16)
    resident = model.capture(ids(40, 0), block_size=16)
    modules = model.decoder(resident, 2, 4)
    assert modules.merge is None and not any(modules.pages_partials)
    monkeypatch.setenv("LONGSTRAW_DECODE_MERGE", "fused")
    monkeypatch.setenv("LONGSTRAW_DECODE_QK", "fused")
    if varlen:
        monkeypatch.setenv("LONGSTRAW_DECODE_PAGES", "varlen")
    attention = [i for i, layer in enumerate(model.model.layers) if layer.is_attention]
    model.model.layers[attention[-1]].self_attn.decode_pages_fn = functools.partial(decode_pages_attention,
                                                                                    num_splits=2)
    fused = model.decoder(resident, 2, 4)
    assert fused.merge is kernel and [fused.pages_partials[i] is not None for i in attention] == [
        True] * (len(attention) - 1) + [False]
    calls = []
    monkeypatch.setattr(fused, "merge", lambda *a: calls.append(1) or kernel(*a))
    assert_decodes_alike(modules, fused, 3, 2e-2)
    assert len(calls) == 3 * (len(attention) - 1)
    monkeypatch.setenv("LONGSTRAW_DECODE_MERGE", "yes")
    with pytest.raises(ValueError, match=r"LONGSTRAW_DECODE_MERGE='yes'; valid: \['modules', 'fused'\]"):
        model.decoder(resident, 2, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_at_qwen36_minis_shape_equals_its_contract():
    """66 page ranges, 32 slot ranges (8 of them filled), 8 responses x 16 heads of 256, bf16 on the GPU."""
    args = [t.cuda() for t in partials(8, 16, 2, 256, 66, 32, torch.bfloat16, seed=0, empty_slots=24)]
    assert rel_err(decode_merge(*args).double(), decode_merge_reference(*args).double()) < 2 ** -9
