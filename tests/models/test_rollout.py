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


def test_a_step_the_compiler_fails_on_runs_uncompiled(caplog):
    """GraphedStep's first call: inductor's BackendCompilerFailed (raised before the compiled graph runs anything)
    leaves the step uncompiled from then on, with one warning; the uncompiled step's own errors still raise."""
    import logging

    import pytest
    from torch._dynamo.exc import BackendCompilerFailed

    from longstraw_cli.rollout.native import GraphedStep

    class Decoder:
        capacity, calls = 4, 0

        def step(self):
            self.calls += 1
            return torch.full((2, 3), float(self.calls))

    def failing_compiled_step():
        raise BackendCompilerFailed("inductor", RuntimeError("triton codegen failed\nmore"), None)

    decoder = Decoder()
    graphed = GraphedStep(decoder)
    graphed.step = failing_compiled_step
    with caplog.at_level(logging.WARNING, logger="longstraw_cli.rollout.native"):
        assert torch.equal(graphed.first_step(), torch.ones(2, 3))
    assert graphed.step == decoder.step and decoder.calls == 1
    assert [r.getMessage() for r in caplog.records if "could not be compiled" in r.getMessage()] == [
        "decode step could not be compiled (RuntimeError: triton codegen failed); decoding uncompiled"]
    graphed.step = failing_compiled_step
    graphed.decoder.step = failing_compiled_step
    with pytest.raises(BackendCompilerFailed):
        graphed.first_step()
