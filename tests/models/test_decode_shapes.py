"""The compiled decode step does not depend on the prompt's length (issue #32, warm-up paid once): one dynamo graph
serves every prompt length of a regime, so a run whose prompts change length compiles the step once, and a second
launch with another prompt length finds that graph in the on-disk compile cache. Traced on CPU with a counting
backend (dynamo's graphs, no inductor): the page count is a dynamic size, the position offset a tensor."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from conftest import ids
from longstraw_cli.models import build_model
from longstraw_cli.models.glm52.routing import RoutingReplay


# P = prompt - 1 pages. With 2 kv heads, P >= 1024 cuts the pages into P // 1024 splits and a tail of 2 or 3 pages here
# (a tail of 1 page is a graph of its own: dynamo specialises sizes of 1); P < 1024 is one piece
@pytest.mark.slow
@pytest.mark.parametrize("lengths", [(3300, 4500, 5000), (300, 700)])
@torch.no_grad()
def test_one_graph_for_every_prompt_length(fresh_dynamo, lengths):
    model = build_model("qwen36_tiny", seed=0, num_hidden_layers=4)
    counter, graphs = CompileCounter(), []
    for n, length in enumerate(lengths):
        resident = model.capture(ids(length, n), block_size=1024)
        eager, compiled = model.decoder(resident, 2, 4), model.decoder(resident, 2, 4)
        step = torch.compile(compiled.step, backend=counter)
        for _ in range(2):
            expected = eager.step()
            assert torch.equal(step(), expected)
            eager.tokens_B.copy_(expected.argmax(-1))
            compiled.tokens_B.copy_(expected.argmax(-1))
        graphs.append(counter.frame_count)
    # the first prompt compiles the step's graphs (several: dynamo cuts the step at gdn_decode, which it does not
    # trace); later prompt lengths compile nothing
    assert graphs == graphs[:1] * len(lengths), f"graphs compiled after each prompt of {lengths} tokens: {graphs}"


@pytest.mark.slow
@torch.no_grad()
def test_glm52_recording_step_compiles_once_whatever_the_layers_and_prompt_lengths(fresh_dynamo):
    """glm52's step with routing replay recording, the trainer's default, compiles its layer function
    (`Glm52Decoder.compiled`): one dynamo graph per kind of layer, whatever the depth and the prompt length. Here
    the kinds are the dense first layer, the MoE layers with a "full" indexer and those with a "shared" one: 3
    graphs for 8 layers, against a recompile limit of 3 that fails when passed (a recompilation per layer, e.g.
    hooks holding a layer index, fails it). The DSA scores and the sparse MLA run as opaque custom ops inside the
    graphs; the page count is dynamic from the first prompt. The records equal eager's."""
    model = build_model("glm52_tiny", seed=0, num_hidden_layers=8)
    routing = RoutingReplay(force=True)
    counter, graphs = CompileCounter(), []
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        for n, length in enumerate((300, 700, 900)):
            resident = model.capture(ids(length, n), block_size=256)
            eager, compiled = model.decoder(resident, 2, 4), model.decoder(resident, 2, 4)
            records = [routing.new_record(model, resident, 2, 4) for _ in range(2)]
            step = compiled.compiled(backend=counter)
            for _ in range(2):
                with routing.recording(records[0], model):
                    expected = eager.step()
                with routing.recording(records[1], model):
                    assert torch.equal(step(), expected)
                eager.tokens_B.copy_(expected.argmax(-1))
                compiled.tokens_B.copy_(expected.argmax(-1))
            assert all(torch.equal(a, b) for a, b in zip(*(r.tensors() for r in records)))
            graphs.append(counter.frame_count)
    assert graphs == [3, 3, 3], f"graphs compiled after each prompt length: {graphs}"


@torch.no_grad()
@pytest.mark.parametrize("gemms", ["each", "grouped"])
def test_glm52_layer_pattern_compiles_one_graph_per_kind_of_layer(fresh_dynamo, gemms, monkeypatch):
    """GLM-5's layer pattern (3 dense layers, then MoE, every indexer "full"; its widths do not matter to dynamo):
    the decode step's layer function compiles 2 graphs, dense and MoE, whatever the depth, and the steps equal
    eager's; with each layer's input linears as one GEMM (a projections object of each layer's own, one of the
    compiled function's inputs) and every linear its own (where the copies would not fit)."""
    from longstraw_cli.models.glm52 import decode

    if gemms == "each":
        monkeypatch.setattr(decode, "device_total_bytes", lambda device: 0)
    model = build_model("glm52_tiny", seed=0, num_hidden_layers=7, first_k_dense_replace=3, indexer_types=None)
    resident = model.capture(ids(300, 0), block_size=256)
    eager, compiled = model.decoder(resident, 2, 4), model.decoder(resident, 2, 4)
    counter = CompileCounter()
    step = compiled.compiled(backend=counter)
    for _ in range(2):
        expected = eager.step()
        assert torch.equal(step(), expected)
        eager.tokens_B.copy_(expected.argmax(-1))
        compiled.tokens_B.copy_(expected.argmax(-1))
    assert counter.frame_count == 2
