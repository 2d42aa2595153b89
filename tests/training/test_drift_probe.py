"""reuse.py's drift probe on random qwen36_tiny and glm52_tiny: the tail re-captured from the kept boundary is the
fresh capture when the weights are those that captured (over several blocks, the tail a whole block or cut from
one) and when the prompt is within the tail (under newer weights), the stale state is put back bit for bit, and
only the first probe_responses responses are scored."""

import pytest
import torch

from conftest import ids, random_model
from longstraw_cli.models.core import capture_blocks
from longstraw_cli.reuse import PromptReuse, ReuseConfig, refusal, tail_recaptured
from longstraw_cli.transaction import TransactionConfig, score

CFG = TransactionConfig(block_size=16)


@pytest.fixture(scope="module", params=["qwen36_tiny", "glm52_tiny"])
def model(request):
    torch.manual_seed(0)
    return random_model(request.param)


def _responses():
    return [ids(5, seed=10 + i) for i in range(3)]


def _nudge_(model, scale=0.02):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _no_scoring(resident, responses):
    raise AssertionError("cycle 0 must not score")


def test_capture_blocks_cut_the_tail_from_the_last_block_only():
    assert capture_blocks(40, 16) == [(0, 16), (16, 32), (32, 40)]
    assert capture_blocks(40, 16, tail=8) == capture_blocks(40, 16, tail=16) == capture_blocks(40, 16)
    assert capture_blocks(40, 16, tail=5) == [(0, 16), (16, 32), (32, 35), (35, 40)]
    assert capture_blocks(32, 16, tail=1) == [(0, 16), (16, 31), (31, 32)]
    assert capture_blocks(11, 16, tail=1024) == [(0, 11)]


@pytest.mark.parametrize("tail, start", [(8, 32), (5, 35)])
def test_probe_puts_the_stale_state_back_and_is_zero_under_the_capturing_weights(model, one_thread, tail, start):
    # 40 captured tokens in blocks of 16: the probe re-captures positions start..39 from the boundary kept there
    prompt = ids(41, seed=1)
    resident = model.capture(prompt, block_size=CFG.block_size, tail=tail)
    assert resident.tail_start == start
    # the cut changes no state: the capture without a tail (fp64, equal to rounding: 2e-14 measured)
    plain = model.capture(prompt, block_size=CFG.block_size)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(resident.tensors(), plain.tensors()))
    before = [t.clone() for t in resident.tensors()]
    with tail_recaptured(model, prompt, resident) as probe:
        same = score(model, probe, _responses(), CFG)
    assert all(torch.equal(a, b) for a, b in zip(resident.tensors(), before))
    stale = score(model, resident, _responses(), CFG)
    assert all(torch.equal(a, b) for a, b in zip(same, stale))


def test_probe_of_a_one_block_prompt_is_the_fresh_capture(model, one_thread):
    prompt = ids(12, seed=2)
    resident = model.capture(prompt, block_size=CFG.block_size, tail=1024)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        _nudge_(model)
        reuse = PromptReuse(ReuseConfig(reuse_steps=2, max_drift=1e-3, probe_responses=3))
        reuse.hold(0, resident)
        # cycle 0 is the capturing weights' own: no probe runs (the test above shows it would give 0)
        assert reuse.measure(model, _no_scoring, prompt, _responses()).max == 0
        reuse.advance(captured=True)
        drift = reuse.measure(model, lambda r, rs: score(model, r, rs, CFG), prompt, _responses())
        fresh = score(model, model.capture(prompt, block_size=CFG.block_size), _responses(), CFG)
        stale = score(model, resident, _responses(), CFG)
        expected = torch.cat([(s - f).abs() for s, f in zip(stale, fresh)])
    finally:
        model.load_state_dict(state)
    assert drift.max == pytest.approx(float(expected.max()), rel=1e-9) and drift.max > 1e-3
    assert reuse.refresh and reuse.due(1)


def test_the_probe_scores_only_the_first_probe_responses(model, one_thread):
    prompt = ids(30, seed=4)
    resident = model.capture(prompt, block_size=CFG.block_size, tail=4)
    scored = []

    def spy(state, responses):
        scored.extend(responses)
        return score(model, state, responses, CFG)

    reuse = PromptReuse(ReuseConfig(reuse_steps=3))
    reuse.hold(0, resident)
    reuse.advance(captured=True)
    reuse.measure(model, spy, prompt, _responses())
    # the default probe: the first 2 responses, each against the stale and the re-captured state
    assert [r.tolist() for r in scored] == [r.tolist() for r in _responses()[:2] * 2]


@pytest.mark.parametrize("field", ["reuse_steps", "probe_responses", "probe_tokens"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_counts_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got {value!r}"):
        ReuseConfig(**{field: value})


def test_refusals_are_one_line():
    k3 = ReuseConfig(reuse_steps=3)
    common = {"gradient": "response_only", "engine": "native", "prompts_per_step": 1}
    assert refusal(k3, **common) is None and refusal(ReuseConfig(), **{**common, "gradient": "exact"}) is None
    for change, word in [({"gradient": "exact"}, "capture.gradient=exact"), ({"engine": "vllm"}, "rollout=vllm"),
                         ({"prompts_per_step": 2}, "prompts_per_step=1")]:
        line = refusal(k3, **{**common, **change})
        assert word in line and "\n" not in line
