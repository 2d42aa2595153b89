"""The decode's DSA top-k as a radix select (`dsa/triton_topk.py`; Triton's interpreter on CPU, compiled on a GPU)
against the rule's reference (`topk_lowest_position`): the same positions, ascending, on exact ties across chunk
boundaries, -0.0 beside +0.0, negatives, infinities and masked (-inf) keys."""

from types import SimpleNamespace

import pytest
import torch

from longstraw_kernels import use_kernels
from longstraw_kernels.dsa.topk import topk_lowest_position, topk_lowest_position_static

pytest.importorskip("triton")
from longstraw_kernels.dsa import triton_topk  # noqa: E402
from longstraw_kernels.dsa.triton_topk import CHUNK, topk_positions_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tricky_rows(S: int, seed: int) -> torch.Tensor:
    """Six rows of S fp32 scores, each a way for the k-th place to fall: distinct values; few values (ties
    everywhere, across chunks); zeros of both signs around the k-th place; negatives and -inf (fewer visible keys
    than k); huge values and +inf; a row all -inf."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(6, S, generator=g)
    rows[1] = torch.randint(-2, 3, (S,), generator=g).float()
    rows[2] = 0.0
    rows[2, ::5] = -0.0
    rows[2, : S // 50] = 1.0
    rows[3] = -torch.rand(S, generator=g)
    rows[3, S // 3:] = float("-inf")
    rows[4] = torch.randn(S, generator=g) * 1e30
    rows[4, ::11] = float("inf")
    rows[5] = float("-inf")
    return rows


# three chunks, the last one partial; and one short chunk (fp16 there: the dtypes share the kernel's fp32 keys)
@pytest.mark.parametrize("S, dtype", [(CHUNK * 2 + 777, torch.float32), (CHUNK * 2 + 777, torch.bfloat16),
                                      (300, torch.float16)])
def test_radix_select_is_the_rule(S, dtype):
    scores = tricky_rows(S, seed=S).to(dtype)
    for k in (1, 64, S // 3 + 5, S // 2, S):  # S // 3 + 5: the k-th place of row 3 among its -inf keys
        want = topk_lowest_position(scores, k)
        got = topk_positions_triton(scores.to(DEVICE), k).cpu()
        assert torch.equal(got, want), (k, (got != want).any(-1).nonzero().flatten().tolist())


def test_rows_strided_and_errors():
    scores = tricky_rows(CHUNK + 100, seed=1)
    wide = torch.zeros(6, CHUNK + 300)
    wide[:, : CHUNK + 100] = scores
    view = wide[:, : CHUNK + 100]  # rows a stride apart that is not S
    assert torch.equal(topk_positions_triton(view.to(DEVICE), 500).cpu(), topk_lowest_position(scores, 500))
    for k in (0, CHUNK + 101):
        with pytest.raises(ValueError, match="k must be in"):
            topk_positions_triton(scores.to(DEVICE), k)


def test_static_rule_on_cuda_takes_the_kernel_behind_one_op(monkeypatch):
    """`topk_lowest_position_static` on CUDA goes through the opaque op to the kernel (or the packed keys under
    kernels.dsa=torch); on CPU it stays the packed keys."""
    calls = []
    real = triton_topk.topk_positions_triton
    monkeypatch.setattr(triton_topk, "topk_positions_triton", lambda s, k: calls.append(k) or real(s, k))
    scores = tricky_rows(700, seed=2).view(2, 3, 700)
    want = topk_lowest_position(scores, 100)
    assert torch.equal(topk_lowest_position_static(scores, 100), want) and not calls
    if torch.cuda.is_available():
        assert torch.equal(topk_lowest_position_static(scores.cuda(), 100).cpu(), want) and calls == [100]
        use_kernels(dsa="torch")
        assert torch.equal(topk_lowest_position_static(scores.cuda(), 100).cpu(), want) and calls == [100]


def test_scores_the_kernel_does_not_take_fall_back_saying_so_once(monkeypatch, caplog):
    from longstraw_kernels.dsa import topk

    monkeypatch.setattr(triton_topk, "supported", lambda scores: False)
    topk._say_the_packed_keys_run.cache_clear()
    scores = tricky_rows(500, seed=3)
    with caplog.at_level("WARNING", logger="longstraw_kernels.dsa.topk"):
        for _ in range(2):
            assert torch.equal(topk._static_topk_op(scores, 50), topk_lowest_position(scores, 50))
    assert sum("radix-select kernel" in r.getMessage() for r in caplog.records) == 1
    topk._say_the_packed_keys_run.cache_clear()


# the capture's rule over long rows (`dsa/triton_threshold.py`): the chunk maxima's bound, the candidates above it,
# the rule on those. tricky_rows' ties, zeros, infinities and all -inf rows, plus a row rising with position (whole
# chunks above the bound: more candidates than the cap) and one with the top-k bunched into its first keys
def threshold_rows(S: int) -> torch.Tensor:
    rows = torch.cat([tricky_rows(S, seed=S), torch.arange(S, dtype=torch.float32)[None],
                      torch.rand(1, S, generator=torch.Generator().manual_seed(1))])
    rows[7, :40] += 2.0
    return rows


# small maxima, cap and block so that the interpreter runs several chunks and blocks a row: S = 1,000
# and 3,001 keys give chunks of 1, 2 and 8 keys (k up to maxima / 2)
@pytest.mark.parametrize("S, k, maxima", [(1000, 64, 1024), (3001, 100, 512), (3001, 24, 512), (1000, 8, 128)])
def test_threshold_select_keeps_the_rule_on_every_row_held_or_not(S, k, maxima):
    from longstraw_kernels.dsa.triton_threshold import threshold_positions_triton

    scores = threshold_rows(S)
    rule = topk_lowest_position(scores, k)
    positions, candidates = threshold_positions_triton(scores.to(DEVICE), k, maxima=maxima, cap=256, block=256)
    over = set((candidates > 256).nonzero()[:, 0].tolist())
    # the all -inf row keeps every key (so may the rows of few values and of +inf in every chunk), the rising row
    # ~k chunks of keys; uniform and bunched scores keep few. A row held takes the rule on its candidates, a row
    # over the cap the rule over the whole row: both give the rule's positions
    chunk = 1 << (-(-S // maxima) - 1).bit_length()
    assert 5 in over and (6 in over) == (k * chunk > 256) and 0 not in over and 7 not in over, over
    if S == 1000:  # the rows of few values and of +inf held: more keys tie at the k-th place than it takes
        assert not {1, 4} & over, over
    assert torch.equal(positions.cpu(), rule)
    with pytest.raises(ValueError, match="k must be in"):
        threshold_positions_triton(scores.to(DEVICE), 129, maxima=maxima, cap=256)


@pytest.mark.parametrize("digit", [None, 3, 8])
def test_threshold_select_over_the_cap_takes_the_whole_row(digit, monkeypatch):
    """Rows whose candidates overflow (a cap of 16): ties at the bound (zeros of both signs, -inf, few values),
    keys strictly above it (rising, falling, and random rows whose best keys are bunched into a few chunks), with
    +inf, huge values, negatives and a masked tail, and the k best one ulp above the bound: every one the rule's
    positions, as `tie_rule_positions` (the rule by its scans alone) gives them, at the module's digit of T a read
    (None) and at others."""
    from longstraw_kernels.dsa import topk, triton_threshold
    from longstraw_kernels.dsa.triton_threshold import threshold_positions_triton

    if digit is not None:
        monkeypatch.setattr(triton_threshold, "DIGIT", digit)

    S, k = 700, 8
    g = torch.Generator().manual_seed(7)
    rows = torch.stack([
        torch.zeros(S), torch.full((S,), float("-inf")), torch.randint(-1, 2, (S,), generator=g).float(),
        torch.arange(S, dtype=torch.float32), torch.arange(S, 0, -1, dtype=torch.float32),
        torch.rand(S, generator=g), torch.randn(S, generator=g) * 1e30, -torch.rand(S, generator=g),
        torch.ones(S),
    ])
    rows[0, ::3] = -0.0
    rows[2, 100] = float("inf")
    rows[5:8, 200:300] += torch.tensor([2.0, 1e31, 2.0])[:, None]
    rows[7, 500:] = float("-inf")
    # the k best one ulp above the bound, all in the first chunk: T is the bound + 1, no digit left after the count
    rows[8, :k] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    positions, candidates = threshold_positions_triton(rows.to(DEVICE), k, maxima=32, cap=16, block=64)
    assert bool((candidates > 16).all()), candidates
    assert torch.equal(positions.cpu(), topk.tie_rule_positions(rows, k))


def test_long_rows_on_cuda_take_the_threshold_select_and_equal_the_rule(monkeypatch, caplog):
    from longstraw_kernels.dsa import topk, triton_threshold

    S = triton_threshold.MIN_KEYS + 1000 if DEVICE == "cuda" else 1000  # (the interpreter: fewer keys)
    scores = threshold_rows(S).reshape(2, 4, S)
    rows = scores.reshape(8, -1)
    # the rule by its scans alone (no top-k), an independent reference
    want = topk.tie_rule_positions(rows, 100).view(2, 4, 100)
    if DEVICE == "cpu":  # the dispatch takes the kernel on CUDA only: the interpreter stands in for it here
        assert topk._threshold_module(rows, 100) is None
        monkeypatch.setattr(topk, "_threshold_module", lambda rows, k: triton_threshold)
        # fewer maxima and candidates a row for the interpreter
        monkeypatch.setattr(triton_threshold, "MAXIMA", 1024)
        monkeypatch.setattr(triton_threshold, "CAP", 256)
    else:
        rows = rows.cuda()
        assert topk._threshold_module(rows, 100) is triton_threshold
        assert topk._threshold_module(rows[:, : triton_threshold.MIN_KEYS - 1], 100) is None
        with caplog.at_level("WARNING", logger="longstraw_kernels"):
            assert topk._threshold_module(rows, triton_threshold.CAP // 2 + 1) is None
        assert any("past the threshold select" in r.getMessage() for r in caplog.records)
        with use_kernels(dsa="torch"):
            assert topk._threshold_module(rows, 100) is None
    # the all -inf row keeps every key: the kernel's whole-row rule serves it
    assert torch.equal(topk_lowest_position(scores.to(DEVICE), 100).cpu(), want)


def test_precompile_takes_the_chunk_sizes_of_the_capture_rows(monkeypatch):
    """One compile per chunk size from MIN_KEYS to the longest row (CHUNK doubles with the keys), each at a row
    length of that size, and the longest row's own length where it is not a multiple of 16; nothing where the
    select would not serve (short rows, k past its cap, a CPU device)."""
    from longstraw_kernels.dsa import topk
    from longstraw_kernels.dsa import triton_threshold as tt

    assert [tt.chunk_size(S) for S in (tt.MIN_KEYS, tt.MIN_KEYS + 1, 1 << 18, (1 << 18) + 1)] == [2, 4, 32, 64]
    warmed = []
    monkeypatch.setattr(tt, "_select_kernel", SimpleNamespace(
        warmup=lambda *args, grid, **meta: warmed.append((args[6], meta["CHUNK"], meta["BLOCK"]))))
    for longest, odd in ((1 << 18, []), ((1 << 18) - 1, [((1 << 18) - 1, 32, tt.BLOCK)])):
        warmed.clear()
        assert tt.precompile(longest, 2048) == 5 + len(odd)
        assert warmed[:5] == [(tt.MAXIMA * c // 2 + 16, c, tt.BLOCK) for c in (2, 4, 8, 16, 32)] and warmed[5:] == odd
        assert all(tt.chunk_size(S) == c for S, c, _ in warmed)
    assert tt.precompile(tt.MIN_KEYS - 1, 2048) == 0
    assert tt.precompile(1 << 18, tt.CAP // 2 + 1) == 0
    assert topk.prepare_topk(1 << 18, 2048, torch.device("cpu")) == 0


def test_a_failed_precompile_is_said_and_leaves_the_select_to_its_calls(monkeypatch, caplog):
    from longstraw_kernels.dsa import topk
    from longstraw_kernels.dsa import triton_threshold as tt

    def broken(longest, k):
        raise TypeError("warmup() got an unexpected keyword argument 'grid'")

    monkeypatch.setattr(tt, "precompile", broken)
    with caplog.at_level("WARNING", logger="longstraw_kernels"):
        assert topk.prepare_topk(1 << 18, 2048, torch.device("cuda")) == 0
    assert any("compiling the threshold select ahead failed (TypeError" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_precompiled_select_compiles_nothing_more_in_the_capture_rows():
    """After `prepare_topk` for rows to 2^17 - 1 keys (four chunk sizes, and that odd length: a prompt's last
    block), rows of each size run without a compile: the warm-ups took the launches' specialisation."""
    from longstraw_kernels.dsa import topk
    from longstraw_kernels.dsa import triton_threshold as tt

    k, longest = 2048, (1 << 17) - 1
    kernel = tt._select_kernel
    compiled = lambda: sum(len(caches[0]) for caches in kernel.device_caches.values())  # noqa: E731
    before = compiled()
    assert topk.prepare_topk(longest, k, torch.device("cuda")) == 5
    made = compiled() - before
    assert made <= 5
    for S in (tt.MIN_KEYS, 3 * tt.MIN_KEYS // 2, 4 * tt.MIN_KEYS, 1 << 17, longest):  # chunk 2, 4, 8, 16, 16
        rows = torch.rand(3, S, device="cuda")
        assert torch.equal(tt.threshold_positions_triton(rows, k)[0].cpu(), topk.tie_rule_positions(rows.cpu(), k))
    assert compiled() - before == made
