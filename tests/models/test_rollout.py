"""Native rollout's sampling: stop tokens end each response, and a seed fixes the samples (decoding agrees with
replay: test_model_contract.py)."""

import torch

from longstraw_cli.models import build_model
from longstraw_cli.rollout.native import SamplingConfig, generate


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
