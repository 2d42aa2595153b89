"""capture.gradient=exact (resident/gradient.py, `CausalLM.prompt_backward`): the gradient of G replays plus the
reverse walk over the prompt equals full-sequence autograd with nothing detached, in fp64, for both families,
blocks that divide the prompt or not, full fine-tuning and LoRA on k/v (which response_only starves); controls
that drop the carried-state or the page gradient are caught; the transaction and the trainer run it."""

import pytest
import torch

from conftest import exact_grads, grads, ids, random_lora_, random_model, response_only_grads, worst_rel_err
from longstraw_cli.resident import AttentionPages
from longstraw_cli.resident.gradient import StateGrad, leaves

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["qwen36_tiny", "glm52_tiny"]
# the bound: <= 1e-10 relative (fp64); measured ~4e-14 (qwen36), ~4e-15 (glm52)
EXACT_TOL = 1e-10
PROMPT, RESPONSE, GROUP = 90, 12, 3


def full_logprobs(model, prompt, response):
    """log p(response | prompt) by one full-sequence forward, nothing detached."""
    logits = model(torch.cat([prompt, response]))
    logp = torch.log_softmax(logits.double(), -1)[prompt.numel() - 1 : -1]
    return logp.gather(-1, response[:, None])[:, 0]


def group():
    responses = [ids(RESPONSE, 10 + i) for i in range(GROUP)]
    weights = [torch.randn(RESPONSE, generator=torch.Generator().manual_seed(20 + i), dtype=torch.float64)
               for i in range(GROUP)]
    return ids(PROMPT, 0), responses, weights


def reference_grads(model, prompt, responses, weights):
    model.zero_grad(set_to_none=True)
    for response, w in zip(responses, weights):
        (w * full_logprobs(model, prompt, response)).sum().backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("block_size, checkpoint_layers", [(16, False), (23, False), (200, False), (23, True)])
def test_exact_gradient_equals_full_sequence_autograd(name, block_size, checkpoint_layers):
    """checkpoint_layers: the walk recomputes each layer's forward inside its backward (the same gradient)."""
    model = random_model(name)
    prompt, responses, weights = group()
    ref = reference_grads(model, prompt, responses, weights)
    got = exact_grads(model, prompt, responses, weights, block_size, checkpoint_layers=checkpoint_layers)
    err = worst_rel_err(got, ref)
    print(f"{name} block {block_size} checkpoint {checkpoint_layers}: exact gradient max rel err {err:.2e}")
    assert err <= EXACT_TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_controls_that_drop_a_state_gradient_are_caught(name):
    """Zeroing what the replays sent into the pages (both families), or into the carried GDN states (qwen36),
    moves the gradient far off the reference: the comparison above discriminates."""
    model = random_model(name)
    prompt, responses, weights = group()
    ref = reference_grads(model, prompt, responses, weights)

    def drop(carried):
        def tamper(state_grad, resident):
            for state, buffers in zip(resident.layers, state_grad.layers):
                if state.CARRIED == carried:
                    for t in buffers.values():
                        t.zero_()
        return tamper

    kinds = [False, True] if name.startswith("qwen36") else [False]
    for carried in kinds:
        assert worst_rel_err(exact_grads(model, prompt, responses, weights, 23, drop(carried)), ref) > 1e-3


@pytest.mark.parametrize("name, targets", [("qwen36_tiny", ("k_proj", "v_proj")),
                                           ("glm52_tiny", ("kv_a_proj_with_mqa",))])
def test_lora_on_keys_and_values_gets_the_prompt_gradient(name, targets):
    """LoRA on the projections that make the prompt's keys/values: exact equals the full-sequence gradient;
    response_only's (the prompt a constant) is a different thing."""
    model = random_model(name)
    random_lora_(model, targets)
    prompt, responses, weights = group()
    ref = reference_grads(model, prompt, responses, weights)
    assert ref and all("lora_" in n for n in ref)
    assert worst_rel_err(exact_grads(model, prompt, responses, weights, 32), ref) <= EXACT_TOL

    assert worst_rel_err(response_only_grads(model, prompt, responses, weights, 32), ref) > 1e-2


def test_walk_refuses_a_capture_without_boundaries():
    model = random_model("qwen36_tiny")
    prompt = ids(20, 0)
    resident = model.capture(prompt, block_size=8)
    with pytest.raises(ValueError, match="boundaries=True"):
        model.prompt_backward(prompt, resident, StateGrad(resident), 8)
    resident = model.capture(prompt, block_size=8, boundaries=True)
    with pytest.raises(ValueError, match="block_size=5 gives 4 blocks"):
        model.prompt_backward(prompt, resident, StateGrad(resident), 5)


class NoPageGradient(torch.autograd.Function):
    """Like the flash backward over zero pages: the pages input gets None, not a zero tensor."""

    @staticmethod
    def forward(ctx, q, pages):
        return q * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def test_leaves_drain_gradients_and_tolerate_none():
    pages = AttentionPages(torch.zeros(3, 2), torch.zeros(3, 2))
    targets = {"k_PKD": torch.zeros(3, 2), "v_PKD": torch.ones(3, 2)}
    view = leaves(pages, targets)
    (view.k_PKD * torch.arange(6.0).view(3, 2)).sum().backward()
    assert torch.equal(targets["k_PKD"], torch.arange(6.0).view(3, 2)) and view.k_PKD.grad is None
    q = torch.ones(2, requires_grad=True)
    NoPageGradient.apply(q, view.v_PKD).sum().backward()
    assert torch.equal(targets["v_PKD"], torch.ones(3, 2))
