"""Native rollout reads the same resident state as replay and agrees with it."""

import torch

from conftest import randomize_, rel_err
from longstraw_cli.models import build_model
from longstraw_cli.rollout.native import SamplingConfig, generate


def test_decode_logprobs_equal_replay_scoring_and_greedy_matches_reference():
    model = build_model("qwen36_tiny", dtype=torch.float64)
    randomize_(model)
    prompt = torch.randint(0, 259, (45,), generator=torch.Generator().manual_seed(0))
    resident = model.capture(prompt, block_size=16)
    snapshot = [t.clone() for t in resident.tensors()]

    rollout = generate(model, resident, 3, SamplingConfig(max_new_tokens=11), torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(snapshot, resident.tensors()))
    for response, logp in zip(rollout.responses, rollout.logprobs):
        assert rel_err(logp, model.logprobs(resident, response)) < 1e-10

    greedy = generate(model, resident, 2, SamplingConfig(temperature=0, max_new_tokens=8)).responses[0]
    with torch.no_grad():
        seq = prompt
        for _ in range(8):
            seq = torch.cat([seq, model(seq)[-1].argmax()[None]])
    assert torch.equal(greedy, seq[prompt.numel():])


def test_stop_tokens_end_each_response_and_sampling_is_seeded():
    model = build_model("qwen36_tiny", seed=0)
    resident = model.capture(torch.randint(0, 259, (30,)), block_size=8)
    cfg = SamplingConfig(max_new_tokens=40, stop_token_ids=tuple(range(0, 259, 3)))
    a = generate(model, resident, 4, cfg, torch.Generator().manual_seed(7))
    b = generate(model, resident, 4, cfg, torch.Generator().manual_seed(7))
    assert all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))
    for r in a.responses:
        stops = [i for i, t in enumerate(r.tolist()) if t % 3 == 0]
        assert stops == [] and len(r) == 40 or stops == [len(r) - 1]
