"""DSA indexer scores: the fused Triton kernel (in Triton's interpreter on CPU) against the torch reference, and
the glm52 model's selection through it.

Legend: B batch, T queries, J index heads, I index head dim, S keys.
"""

import pytest
import torch

from conftest import rel_err
from longstraw_cli.models.glm52 import model as glm52_model
from longstraw_kernels import dsa, use_kernels
from longstraw_kernels.dsa import indexer_scores, indexer_scores_reference

pytest.importorskip("triton")
from longstraw_kernels.dsa import triton_scores  # noqa: E402
from longstraw_kernels.dsa.triton_scores import indexer_scores_triton  # noqa: E402

F64 = torch.float64
# the kernel runs compiled on a GPU machine (Triton's interpreter only when there is no GPU: conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 16**-0.5
# small tiles, so that T=63 and S=1000 cut several of each, partial ones included
TILES = (32, 256, 4, 1)


def make_case(B, T, S, J, I, shared, dtype, seed=0, device=DEVICE):
    """Random queries, weights of both signs (scores go negative, so -inf is not the only non-positive value)
    and keys [S, I] or [B, S, I]. About 1/2^J of the scores are exactly 0 (every head's ReLU at 0): ties."""
    g = torch.Generator().manual_seed(seed)
    q_BTJI = torch.randn(B, T, J, I, generator=g)
    w_BTJ = torch.randn(B, T, J, generator=g)
    k = torch.randn(*(() if shared else (B,)), S, I, generator=g)
    return q_BTJI.to(device, dtype), w_BTJ.to(device), k.to(device, dtype)


def invisible_TS(T, S, offset, device="cpu"):
    t_T1 = torch.arange(T, device=device)[:, None]
    return torch.arange(S, device=device)[None, :] > t_T1 + offset


def compare(out_BTS, ref_BTS, offset):
    """-> RMS-relative error over the finite scores; -inf exactly at s > t + offset, nowhere else."""
    T, S = ref_BTS.shape[-2:]
    assert out_BTS.dtype == torch.float32 and out_BTS.shape == ref_BTS.shape
    expected = torch.zeros(T, S, dtype=torch.bool, device=ref_BTS.device)
    if offset is not None:
        expected = invisible_TS(T, S, offset, ref_BTS.device)
    expected = expected.expand_as(ref_BTS)
    assert torch.equal(torch.isneginf(out_BTS), expected) and torch.equal(torch.isneginf(ref_BTS), expected)
    visible = ~expected
    return rel_err(out_BTS[visible], ref_BTS[visible])


def matches_fp64(out_BTS, q_BTJI, w_BTJ, k, offset, what, scale=SCALE, selection=False):
    """Asserts the kernel's scores within 1e-5 (RMS-relative, finite ones) of the fp64 reference of the same inputs,
    -inf exactly where the reference has it; with `selection`, the model's top-50 the same (ties at 0 included)."""
    ref_BTS = indexer_scores_reference(q_BTJI.to(F64), w_BTJ.to(F64), k.to(F64), scale, offset)
    err = compare(out_BTS, ref_BTS, offset)
    print(f"DSA scores {what} vs fp64 reference: rel err {err:.2e}")
    assert err < 1e-5
    if selection:
        top = glm52_model.topk_lowest_position
        assert torch.equal(top(out_BTS, 50), top(ref_BTS, 50))


# T=63 and S=1000 cut partial tiles at both ends (32 + 31 queries, 3 * 256 + 232 keys); I=24 pads to 32 and
# I=16 is the smallest dot; offset 500 skips whole key tiles, 937 = S - T is capture (the last T positions),
# -10 leaves the first queries with no visible key at all
@pytest.mark.parametrize("I", [16, 24])
@pytest.mark.parametrize("shared", [True, False], ids=["shared_keys", "per_sequence_keys"])
@pytest.mark.parametrize("offset", [None, 500, 937, -10])
def test_fp32_kernel_matches_fp64_reference(I, shared, offset):
    q_BTJI, w_BTJ, k = make_case(2, 63, 1000, 4, I, shared, torch.float32, seed=I + offset if offset else I)
    out_BTS = indexer_scores_triton(q_BTJI, w_BTJ, k, SCALE, offset, config=TILES)
    matches_fp64(out_BTS, q_BTJI, w_BTJ, k, offset, f"fp32 ieee, I={I} shared={shared} offset={offset}",
                 selection=True)


def test_half_precision_dot_matches_fp64_reference_of_the_same_values():
    # the tensor-core branch (fp16 x fp16 -> fp32). Triton's interpreter multiplies bf16 operands as raw bits,
    # so bf16 runs only on a GPU (test_cuda_bf16_realistic_sizes); the two branches are the same code
    q_BTJI, w_BTJ, k = make_case(2, 63, 1000, 4, 24, False, torch.float16, seed=3)
    matches_fp64(indexer_scores_triton(q_BTJI, w_BTJ, k, SCALE, 500, config=TILES), q_BTJI, w_BTJ, k, 500,
                 "fp16 dot")


def test_few_query_rows_take_their_own_tile_and_match():
    # decode's shape (8 responses, one token each, against shared prompt keys): the default tile for T <= 16
    q_BTJI, w_BTJ, k = make_case(1, 8, 1000, 4, 24, True, torch.float16, seed=4)
    assert triton_scores.FEW_ROWS_CONFIG[0] >= 8
    matches_fp64(indexer_scores_triton(q_BTJI, w_BTJ, k, SCALE), q_BTJI, w_BTJ, k, None,
                 "fp16, 8 query rows, default tile")


# the folded form (decode's few rows, heads in the dot's rows): T = 1, 3 (padded to 4) and 8 rows, J = 4 (rows padded
# up to the dot's 16) and 16; block_s 64 cuts S = 1000 into 15 full tiles and a partial one; offset 500 skips whole
# tiles, "early" (-2; 0 for one row) leaves the first queries with no visible key (the last sees the first keys)
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("J", [4, 16])
@pytest.mark.parametrize("shared", [True, False], ids=["shared_keys", "per_sequence_keys"])
@pytest.mark.parametrize("offset", [None, 500, "early"])
def test_folded_kernel_matches_fp64_reference(T, J, shared, offset):
    offset = -min(2, T - 1) if offset == "early" else offset
    q_BTJI, w_BTJ, k = make_case(2, T, 1000, J, 24, shared, torch.float16, seed=T * J + (offset or 0))
    assert triton_scores.folded_serves(q_BTJI, k)
    out_BTS = triton_scores.indexer_scores_folded_triton(q_BTJI, w_BTJ, k, SCALE, offset, block_s=64)
    matches_fp64(out_BTS, q_BTJI, w_BTJ, k, offset, f"folded fp16, T={T} J={J} shared={shared} offset={offset}",
                 selection=True)


# the folded loop's program count: 3 programs over the 16 key tiles (each program 5 or 6 of them, the last partial),
# 1 program over all, and more programs than tiles
@pytest.mark.parametrize("T", [3, 8])
@pytest.mark.parametrize("J", [4, 16])
@pytest.mark.parametrize("offset", [None, 500, "early"])
@pytest.mark.parametrize("programs", [1, 3, 40])
def test_folded_loop_matches_fp64_reference_at_any_program_count(T, J, offset, programs):
    offset = -min(2, T - 1) if offset == "early" else offset
    q_BTJI, w_BTJ, k = make_case(2, T, 1000, J, 24, False, torch.float16, seed=T * J + (offset or 0))
    out_BTS = triton_scores.indexer_scores_folded_triton(q_BTJI, w_BTJ, k, SCALE, offset, block_s=64,
                                                         programs=programs)
    matches_fp64(out_BTS, q_BTJI, w_BTJ, k, offset, f"folded loop fp16, T={T} J={J} offset={offset} "
                 f"programs={programs}", selection=True)


def test_folded_kernel_serves_few_rows_of_half_precision_only(monkeypatch):
    """fp32, mixed dtypes, J not a power of two and more than FOLDED_MAX_ROWS folded rows are refused, and the
    dispatch keeps the head loop's kernel for them; where it serves, the dispatch takes it."""
    def case(T, J, dtype, k_dtype=None):
        q_BTJI, w_BTJ, k = make_case(1, T, 64, J, 16, True, dtype, device="cpu")
        return q_BTJI, k.to(k_dtype or dtype)

    serves = triton_scores.folded_serves
    assert serves(*case(8, 16, torch.float16)) and serves(*case(16, 32, torch.bfloat16))
    assert not serves(*case(8, 16, torch.float32)) and not serves(*case(8, 16, torch.float16, torch.bfloat16))
    assert not serves(*case(8, 6, torch.float16)) and not serves(*case(32, 32, torch.float16))
    with pytest.raises(ValueError, match="folded kernel takes"):
        triton_scores.indexer_scores_folded_triton(*make_case(1, 8, 64, 6, 16, True, torch.float16), SCALE)
    # the folded form launches the loop over key tiles with its heads folded (FOLD_J = J); the head loop, its own
    launched = []

    class Spy:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(triton_scores, name)

        def __getitem__(self, grid):
            return lambda *args, **meta: (launched.append((self.name, meta.get("FOLD_J"))),
                                          self.kernel[grid](*args, **meta))[1]

    for name in ("_indexer_scores_kernel", "_folded_loop_kernel"):
        monkeypatch.setattr(triton_scores, name, Spy(name))
    q_BTJI, w_BTJ, k = make_case(1, 8, 64, 16, 16, True, torch.float16, device="cpu")
    triton_scores.indexer_scores_folded_triton(q_BTJI, w_BTJ, k, SCALE)
    triton_scores.indexer_scores_triton(q_BTJI, w_BTJ, k, SCALE)
    assert launched == [("_folded_loop_kernel", 16), ("_indexer_scores_kernel", None)]
    assert dsa._folded_scores(q_BTJI, k) is triton_scores.indexer_scores_folded_triton
    assert dsa._folded_scores(*case(8, 16, torch.float32)) is None


def test_mixed_dtypes_take_the_fp32_path():
    # bf16 pages with an fp32 model: k is upcast inside the kernel, exactly as the reference upcasts it
    q_BTJI, w_BTJ, k = make_case(1, 63, 300, 4, 16, True, torch.float32, seed=4)
    k = k.to(torch.bfloat16)
    out_BTS = indexer_scores_triton(q_BTJI, w_BTJ, k, SCALE, None, config=TILES)
    err = compare(out_BTS, indexer_scores_reference(q_BTJI.to(F64), w_BTJ.to(F64), k.to(F64), SCALE), None)
    assert err < 1e-5


def test_dispatch_on_cpu_is_the_reference():
    q_BTJI, w_BTJ, k = make_case(2, 9, 40, 4, 16, False, torch.float32, seed=5, device="cpu")
    assert torch.equal(indexer_scores(q_BTJI, w_BTJ, k, SCALE, 3),
                       indexer_scores_reference(q_BTJI, w_BTJ, k, SCALE, 3))


@pytest.mark.usefixtures("one_thread")
def test_glm52_capture_and_replay_through_the_kernel_select_the_same_keys(monkeypatch):
    """Capture (one key group, offset = the block's start) and replay (pages, then the response's own keys as a
    second group with its own offset) with the kernel in place of the reference: same selections, so the same
    log-probs bit for bit. Few rows per scoring call, so the per-chunk offsets are exercised too."""
    from conftest import ids, random_model

    model = random_model("glm52_tiny", torch.float32)
    prompt, responses = ids(150, 11), torch.stack([ids(20, 12), ids(20, 13)])
    resident = model.capture(prompt, block_size=40)
    ref = model.logprobs(resident, responses)

    calls = []

    def kernel(q_BTJI, w_BTJ, k, scale, offset=None):
        calls.append(offset)
        args = (t.to(DEVICE) for t in (q_BTJI, w_BTJ, k))
        return indexer_scores_triton(*args, scale, offset).to(q_BTJI.device)

    monkeypatch.setattr(glm52_model, "indexer_scores", kernel)
    # 2 sequences x 170 keys x 7 rows: replay scores its 20 queries in chunks of 7
    monkeypatch.setitem(glm52_model._SCORE_ELEMENTS, "cpu", 2 * 170 * 7)  # the model runs on the CPU
    resident_k = model.capture(prompt, block_size=40)
    assert all(torch.equal(a, b) for a, b in zip(resident_k.tensors(), resident.tensors()))
    assert torch.equal(model.logprobs(resident_k, responses), ref)
    # the masks really went through the kernel: capture blocks (offsets > 0) and new keys (offsets 0, 7, 14)
    assert any(o is not None and o > 0 for o in calls) and {0, 7, 14} <= set(calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shared", [True, False], ids=["shared_keys", "per_sequence_keys"])
@pytest.mark.parametrize("T", [4096, 8], ids=["capture", "decode_rows"])
def test_cuda_bf16_realistic_sizes(shared, T):
    # capture-like: queries are the last T of S positions (offset S - T); bf16 q and k as the model holds them.
    # T = 8: decode's few rows, which take their own tile (FEW_ROWS_CONFIG) in the head loop's kernel, and which the
    # dispatch gives the folded kernel (test_cuda_folded_decode_rows holds that one to the reference)
    B, S, J, I = (1 if shared else 2), 20000, 16, 128
    q_BTJI, w_BTJ, k = make_case(B, T, S, J, I, shared, torch.bfloat16, device="cuda")
    offset = S - T
    out_BTS = indexer_scores_triton(q_BTJI, w_BTJ, k, I**-0.5, offset)
    folded = dsa._folded_scores(q_BTJI, k)
    assert (folded is not None) == (T == 8)
    assert torch.equal(indexer_scores(q_BTJI, w_BTJ, k, I**-0.5, offset),
                       (folded or indexer_scores_triton)(q_BTJI, w_BTJ, k, I**-0.5, offset)), "dispatch"
    ref_BTS = indexer_scores_reference(q_BTJI.to(F64), w_BTJ.to(F64), k.to(F64), I**-0.5, offset)
    err = compare(out_BTS, ref_BTS, offset)
    print(f"DSA scores bf16 dot vs fp64 reference, B={B} T={T} S={S} J={J} I={I}: rel err {err:.2e}")
    assert err < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("J", [16, 32], ids=["glm52_mini_heads", "glm5_heads"])
def test_cuda_folded_decode_rows(J):
    """The decode's 8 rows against 20,000 shared bf16 keys, the heads folded into the dot's rows, the programs
    looping over the key tiles: as close to the fp64 reference as the head loop's kernel, and what the dispatch runs
    for them."""
    q_BTJI, w_BTJ, k = make_case(1, 8, 20000, J, 128, True, torch.bfloat16, device="cuda")
    out_BTS = triton_scores.indexer_scores_folded_triton(q_BTJI, w_BTJ, k, 128**-0.5, 19990)
    matches_fp64(out_BTS, q_BTJI, w_BTJ, k, 19990, f"folded loop bf16, T=8 J={J}", scale=128**-0.5)
    assert torch.equal(indexer_scores(q_BTJI, w_BTJ, k, 128**-0.5, 19990), out_BTS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_ieee_and_awkward_sizes():
    q_BTJI, w_BTJ, k = make_case(2, 1000, 3001, 16, 72, False, torch.float32, device="cuda")
    for offset in (None, 1500):
        out_BTS = indexer_scores_triton(q_BTJI, w_BTJ, k, SCALE, offset)
        ref_BTS = indexer_scores_reference(q_BTJI.to(F64), w_BTJ.to(F64), k.to(F64), SCALE, offset)
        err = compare(out_BTS, ref_BTS, offset)
        print(f"DSA scores fp32 ieee on CUDA vs fp64 reference, offset={offset}: rel err {err:.2e}")
        assert err < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_torch_choice_forces_the_reference():
    q_BTJI, w_BTJ, k = make_case(1, 100, 300, 4, 16, True, torch.bfloat16, device="cuda")
    with use_kernels(dsa="torch"):
        assert torch.equal(indexer_scores(q_BTJI, w_BTJ, k, SCALE, 250),
                           indexer_scores_reference(q_BTJI, w_BTJ, k, SCALE, 250))
    assert dsa._triton_scores() is not None, "Triton must import on a CUDA machine"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_compiled_graph_op_checks(dtype):
    """`longstraw::dsa_indexer_scores` (what a compiled graph calls): schema, fake shapes and dtype, and the eager
    result, by torch.library.opcheck; shared and per-sequence keys, with and without an offset."""
    from longstraw_kernels.dsa import _indexer_scores_op

    g = torch.Generator().manual_seed(0)
    q, w = torch.randn(2, 5, 3, 16, generator=g).to(dtype), torch.randn(2, 5, 3, generator=g)
    for k in (torch.randn(40, 16, generator=g).to(dtype), torch.randn(2, 40, 16, generator=g).to(dtype)):
        for offset in (None, 7):
            torch.library.opcheck(_indexer_scores_op, (q, w, k, 0.5, offset))
