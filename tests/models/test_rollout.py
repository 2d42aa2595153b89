"""Native rollout's sampling: stop tokens end each response, and a seed fixes the samples (decoding agrees with
replay: test_model_contract.py)."""

import pytest
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


@pytest.mark.parametrize("where", ["compiler", "compiled_step"])
def test_a_step_the_compiler_fails_on_runs_uncompiled_from_a_fresh_decoder(caplog, monkeypatch, where):
    """The rollout's first step: where the compiled step fails (inductor's BackendCompilerFailed, or an error raised
    by what it built), one warning names the inner error and the decode starts again uncompiled from a fresh
    decoder, built after the failed one is gone (its buffers are not held twice); the uncompiled step's own errors
    raise. (GraphedStep stands in for the CUDA graph: the decoders claim a CUDA device, nothing runs there.)"""
    import logging
    import weakref

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
            if self.compile and where == "compiler":
                raise BackendCompilerFailed("inductor", RuntimeError("triton codegen failed\nmore"), None)
            if self.compile:
                # raised in a frame that holds the decoder: the traceback reaches it
                decoder = self.decoder
                raise RuntimeError(f"CUDA error: an illegal memory access in a step of {type(decoder).__name__}")
            return self.decoder.step()

    class Model:
        def __init__(self, fails=False):
            self.built, self.alive_at_build, self.fails = [], [], fails

        def decoder(self, *args, **kwargs):
            self.alive_at_build.append([ref() is not None for ref in self.built])
            decoder = Decoder(self.fails)
            self.built.append(weakref.ref(decoder))
            return decoder

    monkeypatch.setattr(native, "GraphedStep", Graphed)
    model = Model()
    with caplog.at_level(logging.WARNING, logger="longstraw_cli.rollout.native"):
        decoder, step_fn, first = native._first_step(model, None, 2, native.SamplingConfig(), native.NativeConfig())
    assert torch.equal(first, torch.ones(2, 3)) and decoder is model.built[1]()
    # the failed decoder was gone when the second was built
    assert model.alive_at_build == [[], [False]]
    assert not step_fn.compile and step_fn.decoder is decoder
    inner = {"compiler": "RuntimeError: triton codegen failed",
             "compiled_step": "RuntimeError: CUDA error: an illegal memory access in a step of Decoder"}[where]
    assert [r.getMessage() for r in caplog.records if "could not be compiled" in r.getMessage()] == [
        f"decode step could not be compiled ({inner}); decoding uncompiled"]
    # not compiled (rollout.native.compile=false): the step's own error is the error
    with pytest.raises(ValueError, match="a bug of the step itself"):
        native._first_step(Model(fails=True), None, 2, native.SamplingConfig(), native.NativeConfig(compile=False))
