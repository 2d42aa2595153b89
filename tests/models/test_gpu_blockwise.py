"""Blockwise response replay on CUDA (skipped without it), qwen36_mini at 4 layers, bf16, LoRA: the gradient equals
the whole-response replay's within bf16 noise, and every attention backward of a block after the first runs on the
flash kernels (`dispatch.split_new_keys`), never on the fp32 torch reference."""

import pytest
import torch

from conftest import rel_err
from longstraw_cli.lora import LoraConfig, apply_lora
from longstraw_cli.models import build_model
from longstraw_kernels.attention import flash, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_blockwise_replay_runs_on_flash_and_equals_the_whole_replay(monkeypatch):
    model = build_model("qwen36_mini", dtype=torch.bfloat16, device="cuda", seed=0, num_hidden_layers=4)
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
    original = reference.replay_attention_backward
    for module in (reference, flash):
        monkeypatch.setattr(module, "replay_attention_backward",
                            lambda *a, **kw: calls.append(1) or original(*a, **kw))
    model.replay_blocks(resident, response, lambda logp: weights.to(logp.dtype), 256)
    blocks = grads()
    err = max(rel_err(b, w) for b, w in zip(blocks, whole) if w.norm() > 0)
    print(f"blockwise (256 of 700) against whole, bf16: max rel err {err:.2e}; reference backward calls {len(calls)}")
    assert not calls
    assert err <= 3e-2
