"""Blockwise response replay on CUDA (skipped without it), bf16, LoRA, 4 layers: the gradient equals the
whole-response replay's within bf16 noise, and every attention backward of a block runs on the GPU kernels, never on
the torch reference: qwen36_mini's on flash (`dispatch.split_new_keys`), glm52_mini's sparse MLA on the Triton
backward, which forms the gradient of the response's own latent and rope keys (leaves of a block)."""

import pytest
import torch

from conftest import rel_err
from longstraw_cli.lora import LoraConfig, apply_lora
from longstraw_cli.models import build_model
from longstraw_kernels.attention import flash, reference
from longstraw_kernels.mla import reference as mla_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _blockwise_against_whole(name, monkeypatch, patch):
    """(max rel err of the blockwise LoRA gradient against the whole replay's, reference calls during the blocks)."""
    model = build_model(name, dtype=torch.bfloat16, device="cuda", seed=0, num_hidden_layers=4)
    params = apply_lora(model, LoraConfig(rank=16), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (8192,), generator=g).cuda()
    response = torch.randint(0, model.config.vocab_size, (700,), generator=g).cuda()
    resident = model.capture(prompt, block_size=4096)
    weights = torch.rand(len(response), generator=g).cuda()

    def grads():
        out = [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=True)
        return out

    model.logprobs(resident, response, grad=True).float().mul(weights).sum().backward()
    whole = grads()
    calls = []
    patch(calls)
    model.replay_blocks(resident, response, lambda logp: weights.to(logp.dtype), 256)
    blocks = grads()
    err = max(rel_err(b, w) for b, w in zip(blocks, whole) if w.norm() > 0)
    print(f"{name} blockwise (256 of 700) against whole, bf16: max rel err {err:.2e}; reference calls {len(calls)}")
    return err, calls


def test_blockwise_replay_runs_on_flash_and_equals_the_whole_replay(monkeypatch):
    def patch(calls):
        original = reference.replay_attention_backward
        for module in (reference, flash):
            monkeypatch.setattr(module, "replay_attention_backward",
                                lambda *a, **kw: calls.append(1) or original(*a, **kw))

    err, calls = _blockwise_against_whole("qwen36_mini", monkeypatch, patch)
    assert not calls
    assert err <= 3e-2


def test_glm52_blockwise_replay_runs_on_triton_and_equals_the_whole_replay(monkeypatch):
    def patch(calls):
        original = mla_reference._SparseMLA.apply
        monkeypatch.setattr(mla_reference._SparseMLA, "apply", lambda *a: calls.append(1) or original(*a))

    err, calls = _blockwise_against_whole("glm52_mini", monkeypatch, patch)
    assert not calls
    assert err <= 5e-2
