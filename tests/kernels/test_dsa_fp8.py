"""DSA indexer scores in FP8 (`kernels.dsa_scores=fp8`, longstraw_kernels/dsa/fp8.py): the rotation, the per-row
quantisation, the kernel's FP8 dots (Triton's interpreter on CPU, compiled on a GPU) against the exact scores of the
dequantised rows, and glm52 run with it (paths that agree with each other, a selection that overlaps the exact one).

Legend: B batch, T queries, J index heads, I index head dim, S keys.
"""

import functools

import pytest
import torch

from conftest import ids, random_model, rel_err
from longstraw_cli.models.core import StepDecoder
from longstraw_cli.rollout.native import SamplingConfig, generate
from longstraw_kernels import use_kernels
from longstraw_kernels.dsa import Fp8Keys, indexer_scores, indexer_scores_reference, quantize_keys, quantize_queries
from longstraw_kernels.dsa.fp8 import FP8, FP8_MAX, dequantized, quantize_rows, rotated

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 32**-0.5


def sylvester(n):
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


@pytest.mark.parametrize("n", [16, 128])
def test_rotation_is_the_orthonormal_hadamard_matrix(n):
    x = torch.randn(5, 3, n, dtype=F64, generator=torch.Generator().manual_seed(n))
    assert rel_err(rotated(x), x @ sylvester(n)) < 1e-14
    y = torch.randn(7, n, dtype=F64)
    # dot products kept: the scores of rotated rows are the scores of the rows
    assert rel_err(rotated(x) @ rotated(y).T, x @ y.T) < 1e-13
    # not a power of two: left as it is (in fp32 at least)
    odd = torch.randn(3, 24).half()
    assert torch.equal(rotated(odd), odd.float())


def test_rows_quantise_to_e4m3_with_one_scale_each():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    x[5] = 0  # a row of zeros: a positive scale, zero values
    values, scales = quantize_rows(x.bfloat16())
    assert values.dtype == FP8 and scales.dtype == torch.float32 and (scales > 0).all()
    r = rotated(x.bfloat16())
    # each nonzero row's largest |value| is e4m3's largest finite value; the rest round to nearest
    assert torch.equal(values.float().abs().amax(-1)[torch.arange(64) != 5], torch.full((63,), FP8_MAX))
    err = (dequantized(values, scales) - r).abs()
    assert (err <= torch.maximum(r.abs() * 2**-4, scales[:, None] * 2**-9)).all()
    assert (values[5].float() == 0).all()


def case(B, T, S, J, I, shared, seed):
    g = torch.Generator().manual_seed(seed)
    q_BTJI = torch.randn(B, T, J, I, generator=g).bfloat16()
    w_BTJ = torch.randn(B, T, J, generator=g)
    k = torch.randn(*(() if shared else (B,)), S, I, generator=g).bfloat16()
    return q_BTJI.to(DEVICE), w_BTJ.to(DEVICE), k.to(DEVICE)


def exact_of_dequantised(q8_BTJI, w8_BTJ, keys: Fp8Keys, offset):
    return indexer_scores_reference(q8_BTJI.double(), w8_BTJ.double(), dequantized(*keys).double(), SCALE, offset)


def matches(out_BTS, ref_BTS, what):
    finite = torch.isfinite(ref_BTS)
    assert out_BTS.dtype == torch.float32 and torch.equal(torch.isfinite(out_BTS), finite)
    err = rel_err(out_BTS[finite], ref_BTS[finite])
    print(f"FP8 scores {what}: rel err {err:.2e} against the exact scores of the dequantised rows")
    # Hopper's FP8 MMA accumulates in fewer bits than fp32 (Triton's default there): 1.3e-4 measured on an H100
    assert err < (1e-3 if out_BTS.is_cuda else 1e-5)


# the head loop (capture's many rows) and the folded form (decode's few rows); T=63, S=1000 cut partial tiles;
# offset 500 skips whole key tiles, -10 leaves the first queries no key
@pytest.mark.parametrize("shared", [True, False], ids=["shared_keys", "per_sequence_keys"])
@pytest.mark.parametrize("T,offset", [(63, None), (63, 500), (63, -10), (8, None), (3, 500)])
def test_fp8_kernel_equals_the_exact_scores_of_the_dequantised_rows(shared, T, offset):
    pytest.importorskip("triton")
    from longstraw_kernels.dsa import triton_scores

    q_BTJI, w_BTJ, k = case(2, T, 1000, 4, 32, shared, seed=T + (offset or 0))
    q8, w8 = quantize_queries(q_BTJI, w_BTJ)
    keys = quantize_keys(k)
    ref_BTS = exact_of_dequantised(q8, w8, keys, offset)
    if T <= 8:
        assert triton_scores.folded_serves(q8, keys.values)
        out_BTS = triton_scores.indexer_scores_folded_triton(q8, w8, keys.values, SCALE, offset, k_scales=keys.scales,
                                                             block_s=64)
    else:
        out_BTS = triton_scores.indexer_scores_triton(q8, w8, keys.values, SCALE, offset, k_scales=keys.scales,
                                                      config=(32, 256, 4, 1))
    matches(out_BTS, ref_BTS, f"T={T} shared={shared} offset={offset}")
    # the dispatch (the kernel on a GPU with FP8 dots, the reference of the dequantised rows elsewhere)
    matches(indexer_scores(q8, w8, keys, SCALE, offset), ref_BTS, "through indexer_scores")


def test_fp8_scores_are_close_to_the_exact_ones_and_take_fp8_only_together():
    q_BTJI, w_BTJ, k = case(1, 16, 2000, 8, 128, True, seed=1)
    exact_BTS = indexer_scores_reference(q_BTJI.double(), w_BTJ.double(), k.double(), SCALE)
    q8, w8 = quantize_queries(q_BTJI, w_BTJ)
    fp8_BTS = indexer_scores(q8, w8, quantize_keys(k), SCALE)
    # e4m3's 3 mantissa bits round each of q and k by ~3.6% RMS; a dot of random rows keeps about that (0.034 here)
    assert rel_err(fp8_BTS, exact_BTS) < 0.05
    with pytest.raises(ValueError, match="FP8 queries go with Fp8Keys"):
        indexer_scores(q8, w8, k, SCALE)
    with pytest.raises(ValueError, match="FP8 queries go with Fp8Keys"):
        indexer_scores(q_BTJI, w_BTJ, quantize_keys(k), SCALE)


def test_glm52_paths_agree_under_fp8_and_its_selection_overlaps_the_exact_one():
    """With kernels.dsa_scores=fp8 every path scores the same quantised rows: capture + replay give the full-sequence
    reference's log-probs, and the static decoder samples what the eager decode does (fp64). The selection differs
    from the exact one only among near-ties."""
    model = random_model("glm52_tiny", F64)
    prompt, response = ids(120, 0), ids(12, 1)
    attn = model.model.layers[0].self_attn
    with use_kernels(dsa_scores="fp8"):
        resident = model.capture(prompt, block_size=40)
        replayed = model.logprobs(resident, response)
        logits = model(torch.cat([prompt, response]))
        full = torch.log_softmax(logits, -1)[prompt.numel() - 1 : -1].gather(-1, response[:, None])[:, 0]
        assert rel_err(replayed, full) < 1e-10
        cfg = SamplingConfig(max_new_tokens=10)
        static = generate(model, resident, 3, cfg, torch.Generator().manual_seed(4))
        decoder = model.decoder
        model.decoder = functools.partial(StepDecoder, model)
        try:
            eager = generate(model, resident, 3, cfg, torch.Generator().manual_seed(4))
        finally:
            model.decoder = decoder
        assert [r.tolist() for r in static.responses] == [r.tolist() for r in eager.responses]
        for a, b in zip(static.logprobs, eager.logprobs):
            assert rel_err(a, b) < 1e-10
    # the selections of the prompt's last 80 queries, FP8 against exact
    x = torch.randn(1, 120, model.config.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(2))
    chosen = {}
    for mode in ("exact", "fp8"):
        with use_kernels(dsa_scores=mode):
            chosen[mode] = selections(attn, x)[0, 40:]
    overlap = [len(set(a.tolist()) & set(b.tolist())) / a.numel() for a, b in zip(chosen["exact"], chosen["fp8"])]
    print(f"glm52_tiny: FP8 selection overlaps the exact one by {sum(overlap) / len(overlap):.3f} on average")
    assert sum(overlap) / len(overlap) > 0.9


def selections(attn, x_BTC):
    """The DSA top-k of a layer's queries over its own keys (positions 0..T-1, causal)."""
    from longstraw_cli.models.glm52.positions import KeyAxis, rope_cos_sin

    T = x_BTC.shape[1]
    cos, sin = rope_cos_sin(torch.arange(T), attn.cfg.qk_rope_head_dim, attn.cfg.rope_theta, x_BTC.dtype)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x_BTC))
    keys = attn.indexer.keys(x_BTC, cos, sin)[0]
    return attn.select(x_BTC, q_resid, cos, sin, [keys], KeyAxis(num_pages=0, num_new=T, num_queries=T))
