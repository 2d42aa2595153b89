"""`capture.offload=cpu` on CUDA at a 32K-token prompt (skipped without CUDA): capture, graph-free scoring, a
differentiable replay and greedy decode with the pages in pinned host memory against the pages on the GPU, bf16,
kernels on, for both families at a few layers of their mini widths.

What must be identical and what may differ: capture stages each layer's earlier pages into a device window and
runs the on-device kernels on it, so the pages are bit-identical; graph-free scoring stages whole layers, so its
log-probs are too. A replay under autograd stages whole layers too and runs the on-device
kernels (its backward stages them again), so it should match up to those kernels' own run-to-run differences;
the bounds below are the looser ones of its earlier form (the reference kernels over host pages), which it
passed on an H200 before the change. qwen36's decode over staged or device-copied pages runs the same kernels:
greedy tokens identical. glm52's decode over device-copied layers runs the same kernels; over layers left on the
host ("staged" below: no free memory) it moves the distinct selected rows for the same kernel (equal to the
attention over all pages on CPU); its greedy tokens are still compared on the first tokens only and its log-probs
to bf16 closeness, the bounds of its earlier form (the reference kernel over host rows)."""

import copy

import pytest
import torch

from conftest import grads, rel_err
from longstraw_cli.models import build_model
from longstraw_cli.resident import offload as offload_mod
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = 32768
SHAPES = {"qwen36_mini": {"num_hidden_layers": 4}, "glm52_mini": {"num_hidden_layers": 2}}


def model_and_prompt(name):
    model = build_model(name, dtype=torch.bfloat16, device="cuda", seed=0, **SHAPES[name])
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=g).cuda()
    response = torch.randint(0, model.config.vocab_size, (256,), generator=g).cuda()
    return model, prompt, response


def replay(model, resident, response):
    model.zero_grad(set_to_none=True)
    logp = model.logprobs(resident, response, grad=True)
    weights = torch.linspace(-1, 1, logp.numel(), device=logp.device, dtype=logp.dtype)
    (weights * logp).sum().backward()
    return logp.detach(), grads(model)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_offloaded_capture_replay_and_decode_match_on_device(name, monkeypatch):
    model, prompt, response = model_and_prompt(name)
    device = model.capture(prompt, block_size=8192)
    host = model.capture(prompt, block_size=8192, offload="cpu")
    assert all(t.is_cuda for t in device.tensors())
    assert all(t.is_cuda == layer.CARRIED for layer in host.layers for t in layer.tensors())
    assert all(t.is_pinned() for layer in host.layers if not layer.CARRIED for t in layer.tensors())
    for a, b in zip(device.tensors(), host.tensors()):
        assert torch.equal(a, b.cuda())

    batch = torch.stack([response[:64], response[64:128]])
    assert torch.equal(model.logprobs(device, batch), model.logprobs(host, batch))

    logp_d, g_d = replay(model, device, response)
    logp_h, g_h = replay(model, host, response)
    assert rel_err(logp_h.float(), logp_d.float()) < 5e-3
    # the whole gradient as one vector, against the same replay in fp32 on the device: offloading may differ from
    # the device's bf16 replay by bf16's own error, not more. (The first version of this test asked 5e-2 of each
    # parameter against the bf16 replay and failed on the H200 at glm52's embed_tokens, 6.8e-2: a few sparse rows,
    # the reference sparse MLA against the Triton kernel.)
    names = [n for n, g in g_d.items() if g.float().norm() > 0]
    fp32 = copy.deepcopy(model).float()
    _, g_t = replay(fp32, fp32.capture(prompt, block_size=8192), response)
    del fp32

    def vector(g):
        return torch.cat([g[n].float().flatten() for n in names])

    floor = rel_err(vector(g_d), vector(g_t))
    assert rel_err(vector(g_h), vector(g_t)) < 2 * floor + 1e-3, floor

    greedy = SamplingConfig(temperature=0, max_new_tokens=64)
    eager = NativeConfig(cuda_graph=False, compile=False)
    on_device = generate(model, device, 4, greedy, native=eager)
    # the device's free memory as rollout_pages sees it: none (stage per token), plenty (copy once)
    for placement, free in {"staged": 0, "device copy": 1 << 50}.items():
        monkeypatch.setattr(offload_mod, "device_free_bytes", lambda d, free=free: free)
        offloaded = generate(model, host, 4, greedy, native=eager)
        monkeypatch.undo()
        for a, b, la, lb in zip(on_device.responses, offloaded.responses, on_device.logprobs, offloaded.logprobs):
            if name.startswith("qwen36"):
                assert torch.equal(a, b), placement
            else:
                assert torch.equal(a[:8], b[:8]), placement
                n = min(len(a), len(b))
                assert rel_err(lb[:8].float(), la[:8].float()) < 5e-2 and n >= 8
