"""The decode step's sampling kernel (`triton_race.race_sample_triton`, Triton's interpreter on CPU) against its torch
reference: the same token from the same race noise, the same log-prob and entropy at temperature 1, written into
one column of the rollout's [B, R] buffers (so the kernel samples what the reference samples, whose frequencies
are checked here too). On CUDA, tests/kernels/test_gpu.py checks the compiled kernel at a real vocabulary."""

import pytest
import torch

from conftest import rel_err
from longstraw_kernels.sampling import race_sample, race_sample_reference, race_tokens
from longstraw_kernels.sampling.triton_race import race_sample_triton


def sample_both(logits, race, temperature, chunk=None, column=3, width=6):
    """(kernel, reference) outputs, each written into column `column` of zeroed [B, width] buffers."""
    outs = []
    for run in (lambda *a: race_sample_triton(*a, chunk=chunk), lambda *a: race_sample_reference(*a[:3], 1.0, *a[3:])):
        tokens = torch.zeros(logits.shape[0], width, dtype=torch.long)
        logp, entropy = torch.zeros(2, logits.shape[0], width, dtype=logits.dtype)
        run(logits, race, temperature, tokens[:, column], logp[:, column], entropy[:, column])
        others = [c for c in range(width) if c != column]
        assert not tokens[:, others].any() and not logp[:, others].any() and not entropy[:, others].any()
        outs.append((tokens[:, column], logp[:, column], entropy[:, column]))
    return outs


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("B, V, chunk, temperature", [
    (3, 1000, None, 1.0),     # one chunk a row, one partial block
    (2, 5003, 1024, 0.7),     # five chunks, the last short
    (1, 3000, 2048, 1.0),     # two blocks a chunk
    (4, 63, None, 0.0),       # greedy, fewer logits than a block
])
def test_race_kernel_equals_the_reference(dtype, bound, B, V, chunk, temperature):
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(B, V, generator=g) * 3).to(dtype)
    # a token of probability 0, and in row 0 a whole first chunk of them (nothing to merge from it)
    logits[:, 5] = float("-inf")
    logits[0, : min(V // 2, 1024)] = float("-inf")
    race = None if temperature == 0 else torch.empty(B, V, dtype=dtype).exponential_(generator=g)
    (tokens, logp, entropy), (want_tokens, want_logp, want_entropy) = sample_both(logits, race, temperature, chunk)
    assert torch.equal(tokens, want_tokens)
    assert rel_err(logp, want_logp) < bound and rel_err(entropy, want_entropy) < bound
    assert torch.isfinite(logits.gather(1, tokens[:, None])).all()


def test_ties_go_to_the_first_index_across_blocks_and_chunks():
    """Greedy over equal maxima at 10, 1,500 (another block) and 4,000 (another chunk): token 10, as torch's argmax."""
    logits = torch.zeros(2, 5000)
    logits[:, [10, 1500, 4000]] = 2.0
    logits[1, 10] = 1.0  # row 1: the next one, in the second block
    (tokens, _, _), (want, _, _) = sample_both(logits, None, 0.0, chunk=2048)
    assert tokens.tolist() == want.tolist() == [10, 1500]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_exponential_race_samples_the_tempered_softmax(temperature):
    """The reference: argmax p / E, E ~ Exp(1): each token's frequency is its probability (50,000 draws: 4.5 sigma
    at 0.01)."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5]).expand(50_000, -1)
    race = torch.empty(logits.shape).exponential_(generator=torch.Generator().manual_seed(0))
    tokens = race_tokens(logits, race, temperature)
    freq = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    assert (freq - torch.softmax(logits[0].double() / temperature, -1)).abs().max() < 0.01


def test_top_p_and_cpu_logits_take_the_reference():
    """On CPU, and under top_p < 1 anywhere, `race_sample` is the reference."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 50, generator=g)
    race = torch.empty_like(logits).exponential_(generator=g)
    tokens, logp, entropy = torch.empty(2, dtype=torch.long), torch.empty(2), torch.empty(2)
    race_sample(logits, race, 1.0, 0.3, tokens, logp, entropy)
    assert torch.equal(tokens, race_tokens(logits, race, 1.0, 0.3))
    assert rel_err(logp, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]) < 1e-6
