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


def test_a_step_the_compiler_fails_on_runs_uncompiled_from_a_fresh_decoder(caplog, monkeypatch):
    """The rollout's first step: where the compiled step fails (inductor's BackendCompilerFailed here), one warning
    names the inner error and the decode starts again uncompiled from a fresh decoder; the uncompiled step's own
    errors raise. (GraphedStep stands in for the CUDA graph: the decoders claim a CUDA device, nothing runs there.)"""
    import logging

    import pytest
    from torch._dynamo.exc import BackendCompilerFailed

    from longstraw_cli.rollout import native

    class Decoder:
        device, graph_safe, compile_safe, capacity = torch.device("cuda"), True, True, 4

        def __init__(self, fails=False):
            self.fails = fails

        def step(self):
            if self.fails:
                raise ValueError("a bug of the step itself")
            return torch.ones(2, 3)

    class Graphed:
        def __init__(self, decoder, compile=False):
            self.decoder, self.compile = decoder, compile

        def __call__(self):
            if self.compile:
                raise BackendCompilerFailed("inductor", RuntimeError("triton codegen failed\nmore"), None)
            return self.decoder.step()

    class Model:
        def __init__(self, fails=False):
            self.built, self.fails = [], fails

        def decoder(self, *args, **kwargs):
            self.built.append(Decoder(self.fails))
            return self.built[-1]

    monkeypatch.setattr(native, "GraphedStep", Graphed)
    model = Model()
    with caplog.at_level(logging.WARNING, logger="longstraw_cli.rollout.native"):
        decoder, step_fn, first = native._first_step(model, None, 2, native.SamplingConfig(), native.NativeConfig())
    assert torch.equal(first, torch.ones(2, 3)) and len(model.built) == 2 and decoder is model.built[1]
    assert not step_fn.compile and step_fn.decoder is decoder
    assert [r.getMessage() for r in caplog.records if "could not be compiled" in r.getMessage()] == [
        "decode step could not be compiled (RuntimeError: triton codegen failed); decoding uncompiled"]
    # not compiled (rollout.native.compile=false): the step's own error is the error
    with pytest.raises(ValueError, match="a bug of the step itself"):
        native._first_step(Model(fails=True), None, 2, native.SamplingConfig(), native.NativeConfig(compile=False))
