"""`capture(offload="cpu")` against pages on the device, for both families, bit for bit: the captured state, the
log-probs (graph-free and under autograd), full and LoRA gradients of a replay, and greedy rollouts, in both of
qwen36's decode placements (pages copied to the device for the rollout, or staged per token). On CPU the "device"
and the host are the same memory, so the host path runs with plain copies: equality here means the staging,
block windows and write-backs put every value where the on-device path has it. The CUDA comparison at a long
prompt is tests/models/test_gpu_offload.py."""

import weakref

import pytest
import torch

from conftest import ids, random_lora_, random_model, replay_grads
from longstraw_cli.models.spec import family_of
from longstraw_cli.resident import offload as offload_mod
from longstraw_cli.resident.offload import host_bytes
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate

FAMILIES = ("qwen36_tiny", "glm52_tiny")


def captures(model, prompt, block_size):
    return model.capture(prompt, block_size=block_size), model.capture(prompt, block_size=block_size, offload="cpu")


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
def test_offloaded_qlora_replay_is_bit_identical(name):
    """QLoRA (NF4 base weights, LoRA adapters) over offloaded pages: the replay's log-probs and adapter gradients
    equal those over on-device pages (the NF4 weights pass the replay's saved-tensor hooks untouched)."""
    pytest.importorskip("torchao")
    from longstraw_cli.models import build_model

    model = build_model(name, dtype=torch.float32, seed=0, quantize="nf4")
    random_lora_(model, family_of(model).lora_targets)
    device, host = captures(model, ids(40, 10), 16)
    logp_d, g_d = replay_grads(model, device, [ids(6, 11)])
    logp_h, g_h = replay_grads(model, host, [ids(6, 11)])
    assert torch.equal(logp_d[0], logp_h[0])
    assert sorted(g_d) == sorted(g_h) and g_d and all("lora_" in n for n in g_d)
    for n in g_d:
        assert torch.equal(g_d[n], g_h[n]), n


@pytest.mark.parametrize("name", FAMILIES)
def test_replay_keeps_no_staged_copy_for_its_backward(name, monkeypatch):
    """Under autograd each layer's pages are staged whole for the forward (the fast kernels read them on the
    device), but what the graph saves for backward is the host pages: after the forward no staged copy is alive
    (the gradients are those of the on-device state: the test above). The backward reaches the layers last first:
    it stages each paged layer again once, in that order, one ahead (the next one's copy issued while this one's
    backward runs), so no more than two layers' copies are alive while it runs."""
    model = random_model(name)
    host = model.capture(ids(60, 6), block_size=16, offload="cpu")
    issued = {1: [], -1: []}  # stager direction -> [(layer, weak references to its copy's tensors)]
    alive_in_backward = []
    stage, unpack = offload_mod.LayerStager._issue, offload_mod._HostSaved.unpack

    def issue(self, i):
        stage(self, i)
        issued[self.step].append((i, [weakref.ref(t) for t in self.pending[i][0].tensors()]))

    def counting(self, packed):
        out = unpack(self, packed)
        alive_in_backward.append(sum(any(r() is not None for r in refs) for _, refs in issued[-1]))
        return out

    monkeypatch.setattr(offload_mod.LayerStager, "_issue", issue)
    monkeypatch.setattr(offload_mod._HostSaved, "unpack", counting)
    logp = model.logprobs(host, ids(9, 7), grad=True)
    paged = [i for i, layer in enumerate(host.layers) if not layer.CARRIED]
    assert paged and [i for i, _ in issued[1]] == paged and not issued[-1]
    assert all(r() is None for _, refs in issued[1] for r in refs), "a staged copy outlived the forward"
    logp.sum().backward()
    assert [i for i, _ in issued[-1]] == paged[::-1], "the backward did not stage each layer once, last first"
    assert alive_in_backward and max(alive_in_backward) <= 2


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("placement", ["staged", "part copied", "device copy", "capped at 0"])
def test_offloaded_rollout_is_bit_identical(name, placement, monkeypatch):
    """Greedy and sampled rollouts (tokens and log-probs) from offloaded pages equal those from device pages.
    qwen36: "staged" moves every attention layer's pages per token (a CPU device has no memory of its own, so this
    is what runs on CPU); "device copy" is what a GPU with room does, "part copied" one with room for one layer's
    pages (forced here by reporting free memory), "capped at 0" one with room where
    rollout.native.offload_copy_gib=0 keeps every page on the host."""
    model = random_model(name)
    device, host = captures(model, ids(60, 9), 16)
    native = NativeConfig(offload_copy_gib=0) if placement == "capped at 0" else NativeConfig()
    if placement != "staged":
        one = max(sum(t.nbytes for t in state.tensors()) for state in host.layers if not state.CARRIED)
        free = int(one * 1.1) + 1 if placement == "part copied" else 1 << 40
        monkeypatch.setattr(offload_mod, "device_free_bytes", lambda device: free)
    decoders, make = [], model.decoder
    monkeypatch.setattr(model, "decoder", lambda *args, **kwargs: decoders.append(make(*args, **kwargs)) or
                        decoders[-1])
    for sampling, seed in ((SamplingConfig(temperature=0, max_new_tokens=12), None),
                           (SamplingConfig(temperature=1.0, max_new_tokens=12), 3)):
        runs = [generate(model, r, 3, sampling, None if seed is None else torch.Generator().manual_seed(seed),
                         native=native) for r in (device, host)]
        for a, b in zip(runs[0].responses + runs[0].logprobs, runs[1].responses + runs[1].logprobs):
            assert torch.equal(a, b)
    # the offloaded rollouts' decoders (every other one is the on-device run's): which layers stayed on the host
    paged = [not state.CARRIED for state in host.layers]
    left = {"staged": paged, "capped at 0": paged, "device copy": [False] * len(paged)}.get(placement)
    for decoder in decoders[1::2]:
        assert left is None or decoder.on_host == left
        assert placement != "part copied" or sum(decoder.on_host) == sum(paged) - 1


@pytest.mark.parametrize("name", FAMILIES)
def test_decode_placement(name, monkeypatch):
    """Offloaded decode, both families: the paged layers that fit in the device's free memory (10% spare) are
    copied once, first layers first; the others stay in host memory (qwen36 stages them per step, glm52 reads
    their selected rows). All copied: CUDA-graph safe; any left on the host: eager. qwen36's GDN states are never
    offloaded: they stay the device's."""
    from longstraw_cli.models.glm52.decode import Glm52Decoder
    from longstraw_cli.models.qwen36.decode import Qwen36Decoder

    Decoder = Qwen36Decoder if name.startswith("qwen36") else Glm52Decoder
    model = random_model(name)
    host = model.capture(ids(40, 1), block_size=16, offload="cpu")
    paged = [not state.CARRIED for state in host.layers]
    staged = Decoder(model, host, 2, 4)
    assert staged.on_host == paged and not staged.graph_safe
    need = host_bytes(host.nbytes())
    if Decoder is Qwen36Decoder:
        assert need == host.nbytes()["kv_pages"] and need < host.nbytes()["total"]
    sizes = [sum(t.nbytes for t in state.tensors()) if p else 0 for state, p in zip(host.layers, paged)]
    first = paged.index(True)
    # room for the first paged layer alone: it is copied, the rest not
    monkeypatch.setattr(offload_mod, "device_free_bytes", lambda device: int(sizes[first] * 1.1) + 1)
    partly = Decoder(model, host, 2, 4)
    assert partly.on_host == [p and i != first for i, p in enumerate(paged)] and not partly.graph_safe
    assert partly.pages[first] is not host.layers[first]
    # room for all but the last paged layer
    last = len(paged) - 1 - paged[::-1].index(True)
    monkeypatch.setattr(offload_mod, "device_free_bytes", lambda device: int((need - sizes[last]) * 1.1) + 1)
    assert Decoder(model, host, 2, 4).on_host == [i == last for i in range(len(paged))]
    monkeypatch.setattr(offload_mod, "device_free_bytes", lambda device: int(need * 1.2))
    copied = Decoder(model, host, 2, 4)
    assert copied.graph_safe and not any(copied.on_host)
    # rollout.native.offload_copy_gib caps the copies below the free memory: the first layer's bytes, or none
    # (layers that do not fit are skipped, later smaller ones still copied: below the smallest, none is)
    assert Decoder(model, host, 2, 4, page_budget=sizes[first]).on_host == partly.on_host
    assert Decoder(model, host, 2, 4, page_budget=min(n for n in sizes if n) - 1).on_host == paged
    assert Decoder(model, host, 2, 4, page_budget=0).on_host == paged
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
    # the offloaded capture keeps the tail (capture.reuse_steps' drift probe), here 5 positions cut from the last block
    device = model.capture(ids(40, 2), block_size=16, tail=5)
    host = model.capture(ids(40, 2), block_size=16, offload="cpu", tail=5)
    assert device.tail_start == host.tail_start == 34
    assert all(torch.equal(a, b) for a, b in zip(device.tensors(), host.tensors()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glm52_selected_rows_give_the_same_attention(dtype):
    """glm52 decode over pages left in host memory moves only the selected rows, each once, and renumbers the
    selection into them (the MLA dispatch does this when the pages are on another device than q): the sparse
    attention reads the same keys in the same order, so the result is bit for bit the one over all pages
    (duplicates across rows, -1 entries, rows with nothing selected)."""
    from longstraw_kernels.mla import sparse_mla_attention
    from longstraw_kernels.mla.dispatch import selected_rows

    g = torch.Generator().manual_seed(0)
    P, L, R, B, T, H, K = 300, 16, 8, 2, 3, 4, 24
    latent_PL, rope_PR = (torch.randn(P, n, generator=g).to(dtype) for n in (L, R))
    q_BTHA = torch.randn(B, T, H, L + R, generator=g).to(dtype)
    idx_BTK = torch.randint(0, 60, (B, T, K), generator=g) * 5   # many repeats, within [0, P)
    idx_BTK[0, 1, ::3] = -1
    idx_BTK[1, 2] = -1
    latent_UL, rope_UR, idx_UTK = selected_rows(latent_PL, rope_PR, idx_BTK, torch.device("cpu"))
    assert latent_UL.shape[0] == torch.unique(idx_BTK.clamp(min=0)).numel() < P
    assert torch.equal(idx_UTK < 0, idx_BTK < 0)
    assert torch.equal(latent_UL[idx_UTK.clamp(min=0)], latent_PL[idx_BTK.clamp(min=0)])
    full = sparse_mla_attention(q_BTHA, latent_PL, rope_PR, idx_BTK, scale=0.3)
    compact = sparse_mla_attention(q_BTHA, latent_UL, rope_UR, idx_UTK, scale=0.3)
    for a, b in zip(full, compact):
        assert torch.equal(a, b)
