"""glm52's own checks: top-k ties, latent-only resident bytes, offloaded capture, a transaction that moves the
experts and not the indexer, LoRA on every linear. The model contract that every family meets (capture and replay
against the full-sequence reference, gradients, immutability, rollout) is in test_model_contract.py."""

import pytest
import torch

from conftest import grads, ids, random_model, rel_err
from longstraw_cli.distributed.strategy import LocalStrategy
from longstraw_cli.models.glm52.model import topk_lowest_position
from longstraw_cli.rl.losses import LossConfig
from longstraw_cli.transaction import Transaction, TransactionConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(dtype=torch.float64, seed=0):
    return random_model("glm52_tiny", dtype, seed)


def reference_logprobs(model, prompt, response, grad_prefix):
    logits = model(torch.cat([prompt, response]), grad_prefix=grad_prefix)
    logp = torch.log_softmax(logits.double(), -1)[prompt.numel() - 1 : -1]
    return logp.gather(-1, response[:, None])[:, 0]


def test_topk_ties_go_to_the_lower_position():
    scores = torch.tensor([[[0.0, 2.0, 0.0, 1.0, 0.0, 0.0, float("-inf")]]])
    assert topk_lowest_position(scores, 3).tolist() == [[[0, 1, 3]]]
    assert topk_lowest_position(scores, 5).tolist() == [[[0, 1, 2, 3, 4]]]
    # fewer finite than k: masked positions fill up, lowest first (the model drops them as not visible)
    assert topk_lowest_position(scores[..., 4:], 3).tolist() == [[[0, 1, 2]]]
    x = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(topk_lowest_position(x, 7), x.topk(7).indices.sort(-1).values)


@pytest.mark.parametrize("page_dtype", [None, torch.bfloat16])
def test_resident_bytes_are_latent_pages_only(page_dtype):
    model = tiny(torch.float32)
    cfg = model.config
    resident = model.capture(ids(130, 3), block_size=50, page_dtype=page_dtype)
    assert resident.nbytes() == model.resident_bytes(129, page_dtype)
    size = 2 if page_dtype is torch.bfloat16 else 4
    num_full = cfg.layer_indexer_types.count("full")
    per_token = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + num_full * cfg.index_head_dim
    assert resident.nbytes()["total"] == 129 * per_token * size
    # no expanded per-head K/V anywhere: that would be H * (qk_head_dim + v_head_dim) per token per layer
    expanded = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    assert per_token < expanded
    shared = [i for i, t in enumerate(cfg.layer_indexer_types) if t == "shared"]
    assert shared and all(resident.layers[i].index_PI is None for i in shared)


@pytest.mark.parametrize("block_size", [16, 45, 1000])
def test_offloaded_span_capture_is_identical_to_layer_by_layer_capture(block_size):
    """`capture_span(offload="cpu")` (PageWriter: each layer's pages copied to the host once) against the same on
    the device; `capture(offload="cpu")`, block by block, is tests/models/test_offload.py's."""
    model = tiny()
    prompt, response = ids(110, 7), ids(15, 8)
    blockwise = model.capture(prompt, block_size=block_size)
    span = model.capture_span(prompt[:-1], start=0, num_tokens=109, last_token=int(prompt[-1]), block_size=block_size)
    offloaded = model.capture_span(prompt[:-1], start=0, num_tokens=109, last_token=int(prompt[-1]),
                                   block_size=block_size, offload="cpu")
    assert offloaded.offload == "cpu" and all(t.device.type == "cpu" for t in offloaded.tensors())
    assert offloaded.nbytes() == blockwise.nbytes()
    for b, c in zip(span.tensors(), offloaded.tensors()):
        assert torch.equal(c, b)

    def logp_and_grads(resident):
        model.zero_grad(set_to_none=True)
        logp = model.logprobs(resident, response, grad=True)
        logp.sum().backward()
        return logp.detach(), grads(model)

    lp_span, g_span = logp_and_grads(span)
    lp_off, g_off = logp_and_grads(offloaded)
    assert torch.equal(lp_off, lp_span)
    assert g_off.keys() == g_span.keys() and all(torch.equal(g_off[n], g_span[n]) for n in g_span)
    with pytest.raises(ValueError, match="offload"):
        model.capture(prompt, offload="disk")


def test_transaction_runs_and_changes_parameters():
    model = tiny(torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 259, (60,), generator=g)
    strategy = LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=0.5), max_grad_norm=1.0)
    tx = Transaction(model, strategy, LossConfig(name="grpo"), TransactionConfig(block_size=16))
    for _ in range(2):
        responses = [torch.randint(0, 259, (10,), generator=g) for _ in range(3)]
        result = tx.run(prompt, responses, torch.rand(3, generator=g), tx.capture(prompt))
        assert torch.isfinite(torch.tensor(result.stats["grad_norm"])) and result.stats["grad_norm"] > 0
        assert result.graph_live_bytes_after == 0
        assert result.resident_bytes == model.resident_bytes(59)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "model.layers.1.mlp.experts.gate_up_proj" in changed and "lm_head.weight" in changed
    assert not any(".indexer." in n for n in changed)


def test_lora_on_every_glm52_linear_including_absorbed_kv_b():
    from longstraw_cli.lora import LoraConfig, apply_lora

    model = tiny()
    targets = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj")
    adapters = apply_lora(model, LoraConfig(rank=2, target_modules=targets))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in adapters:
            p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    prompt, response = ids(60, 12), ids(10, 13)
    reference_logprobs(model, prompt, response, prompt.numel() - 1).sum().backward()
    ref = [p.grad.clone() for p in adapters]
    model.zero_grad(set_to_none=True)
    model.logprobs(model.capture(prompt, block_size=16), response, grad=True).sum().backward()
    assert len(ref) == len(adapters) and all(p.grad is not None for p in adapters)
    # an expert no token routes to gets exactly zero in both (rel_err refuses an all-zero reference)
    assert all(torch.equal(p.grad, r) for p, r in zip(adapters, ref) if r.norm() == 0)
    assert sum(r.norm() > 0 for r in ref) > len(ref) // 2
    assert max(rel_err(p.grad, r) for p, r in zip(adapters, ref) if r.norm() > 0) < 1e-10
    kv_b = model.model.layers[0].self_attn.kv_b_proj
    assert kv_b.lora_B.grad.norm() > 0
