"""`capture(offload="cpu")` against pages on the device, for both families, bit for bit: the captured state, the
log-probs (graph-free and under autograd), full and LoRA gradients of a replay, and greedy rollouts, in both of
qwen36's decode placements (pages copied to the device for the rollout, or staged per token). On CPU the "device"
and the host are the same memory, so the host path runs with plain copies: equality here means the staging,
block windows and write-backs put every value where the on-device path has it. The CUDA comparison at a long
prompt is tests/models/test_gpu_offload.py."""

import pytest
import torch

from conftest import grads, ids, random_lora_, random_model
from longstraw_cli.models.spec import family_of
from longstraw_cli.resident import offload as offload_mod
from longstraw_cli.resident.offload import host_bytes
from longstraw_cli.rollout.native import SamplingConfig, generate

FAMILIES = ("qwen36_tiny", "glm52_tiny")


def captures(model, prompt, block_size):
    return model.capture(prompt, block_size=block_size), model.capture(prompt, block_size=block_size, offload="cpu")


def replay_grads(model, resident, responses):
    model.zero_grad(set_to_none=True)
    logps = []
    for i, response in enumerate(responses):
        logp = model.logprobs(resident, response, grad=True)
        ((i + 1.0) * logp).sum().backward()
        logps.append(logp.detach())
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return logps, out


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("block_size", [16, 23, 500])
def test_offloaded_capture_and_logprobs_are_bit_identical(name, block_size):
    model = random_model(name)
    prompt = ids(90, 3)
    device, host = captures(model, prompt, block_size)
    assert host.offload == "cpu" and device.offload is None
    assert host.nbytes() == device.nbytes()
    assert host.num_tokens == device.num_tokens and host.last_token == device.last_token
    for a, b in zip(device.tensors(), host.tensors()):
        assert torch.equal(a, b)
    responses = torch.stack([ids(11, 4), ids(11, 5)])
    assert torch.equal(model.logprobs(device, responses), model.logprobs(host, responses))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("lora", [False, True])
def test_offloaded_replay_gradients_are_bit_identical(name, lora):
    model = random_model(name)
    if lora:
        random_lora_(model, family_of(model).lora_targets)
    prompt = ids(70, 6)
    device, host = captures(model, prompt, 16)
    responses = [ids(9, 7), ids(5, 8)]
    logp_d, g_d = replay_grads(model, device, responses)
    logp_h, g_h = replay_grads(model, host, responses)
    assert all(torch.equal(a, b) for a, b in zip(logp_d, logp_h))
    assert sorted(g_d) == sorted(g_h) and g_d
    if lora:
        assert all("lora_" in n for n in g_d)
    for n in g_d:
        assert torch.equal(g_d[n], g_h[n]), n
    # the replays read the offloaded state, never write it
    for a, b in zip(device.tensors(), host.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("placement", ["staged", "part copied", "device copy"])
def test_offloaded_rollout_is_bit_identical(name, placement, monkeypatch):
    """Greedy and sampled rollouts (tokens and log-probs) from offloaded pages equal those from device pages.
    qwen36: "staged" moves every attention layer's pages per token (a CPU device has no memory of its own, so this
    is what runs on CPU); "device copy" is what a GPU with room does, "part copied" one with room for one layer's
    pages (forced here by reporting free memory)."""
    model = random_model(name)
    device, host = captures(model, ids(60, 9), 16)
    if placement != "staged":
        one = max(sum(t.nbytes for t in state.tensors()) for state in host.layers if not state.CARRIED)
        free = 1 << 40 if placement == "device copy" else int(one * 1.1) + 1
        monkeypatch.setattr(offload_mod, "device_free_bytes", lambda device: free)
    for sampling, seed in ((SamplingConfig(temperature=0, max_new_tokens=12), None),
                           (SamplingConfig(temperature=1.0, max_new_tokens=12), 3)):
        runs = [generate(model, r, 3, sampling, None if seed is None else torch.Generator().manual_seed(seed))
                for r in (device, host)]
        for a, b in zip(runs[0].responses + runs[0].logprobs, runs[1].responses + runs[1].logprobs):
            assert torch.equal(a, b)


def test_qwen36_decode_placement(monkeypatch):
    """Offloaded qwen36 decode: the attention layers' pages that fit in the device's free memory (10% spare) are
    copied once, first layers first; the others are staged at every step. All copied: CUDA-graph safe; any staged:
    eager. GDN states are never offloaded: they stay the device's."""
    from longstraw_cli.models.qwen36.decode import Qwen36Decoder

    model = random_model("qwen36_tiny")
    host = model.capture(ids(40, 1), block_size=16, offload="cpu")
    paged = [not state.CARRIED for state in host.layers]
    staged = Qwen36Decoder(model, host, 2, 4)
    assert staged.on_host == paged and not staged.graph_safe
    need = host_bytes(host.nbytes())
    assert need == host.nbytes()["kv_pages"] and need < host.nbytes()["total"]
    one = need // sum(paged)
    # room for one attention layer's pages (of two): the first is copied, the second staged
    monkeypatch.setattr(offload_mod, "device_free_bytes", lambda device: int(one * 1.1) + 1)
    partly = Qwen36Decoder(model, host, 2, 4)
    first = paged.index(True)
    assert partly.on_host == [p and i != first for i, p in enumerate(paged)] and not partly.graph_safe
    assert partly.pages[first] is not host.layers[first]
    monkeypatch.setattr(offload_mod, "device_free_bytes", lambda device: int(need * 1.05))
    assert sum(Qwen36Decoder(model, host, 2, 4).on_host) == 1
    monkeypatch.setattr(offload_mod, "device_free_bytes", lambda device: int(need * 1.2))
    copied = Qwen36Decoder(model, host, 2, 4)
    assert copied.graph_safe and not any(copied.on_host)
    for state, pages in zip(host.layers, copied.pages):
        if state.CARRIED:
            assert pages is state
        else:
            assert pages is not state and all(torch.equal(a, b) for a, b in zip(state.tensors(), pages.tensors()))


def test_offload_refusals():
    model = random_model("qwen36_tiny")
    with pytest.raises(ValueError, match="offload='disk'; valid"):
        model.capture(ids(20, 1), offload="disk")
    with pytest.raises(ValueError, match="exact gradients"):
        model.capture(ids(20, 1), offload="cpu", boundaries=True)
    # the offloaded capture keeps the tail (capture.reuse_steps' drift probe)
    device = model.capture(ids(40, 2), block_size=16, tail=True)
    host = model.capture(ids(40, 2), block_size=16, offload="cpu", tail=True)
    assert all(torch.equal(a, b) for a, b in zip(device.tensors(), host.tensors()))
