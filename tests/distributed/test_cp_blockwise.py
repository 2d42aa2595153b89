"""Blockwise response replay (`capture.replay_block`, models/blockwise.py) under context parallel (gloo, 2 CPU
ranks): every rank's gradient equals one rank's whole-response replay (fp64, <= 1e-12 relative), response_only and
exact (the prompt's walk after the blockwise replays), qwen36 with LoRA on k/v and glm52 with ep=2 inside the CP
group; blockwise scoring of a right-padded batch equals one rank's log-probs. The response is replicated on every
rank: the response's own keys are attended on every rank (the new-key part of the CP attention), never merged
across ranks as if they were pages. Under ddp with two data-parallel ranks the blockwise transaction gives the
one-process average of whole replays."""

import os

import pytest
import torch
import torch.distributed as dist

from conftest import grads, ids, join_gloo, random_lora_, random_model, rank_results, rel_err, worst_rank_err
from longstraw_cli.distributed.cp import apply_context_parallel
from longstraw_cli.distributed.ep import apply_expert_parallel
from longstraw_cli.resident.gradient import StateGrad

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PROMPT, RESPONSE, BLOCK, CAPTURE_BLOCK = 61, 17, 6, 16
# (name, model, LoRA targets, ep)
CASES = [("qwen36_lora_kv", "qwen36_tiny", ("k_proj", "v_proj", "in_proj_qkv"), 1),
         ("glm52_ep2", "glm52_tiny", None, 2)]
TOL = 1e-12


def make_model(name, lora):
    model = random_model(name, seed=3)
    if lora is not None:
        random_lora_(model, lora)
    return model


def weights():
    return torch.randn(RESPONSE, generator=torch.Generator().manual_seed(20), dtype=torch.float64)


def loss_grad(logp_R):
    leaf = logp_R.detach().requires_grad_()
    ((weights() * leaf).sum() / leaf.numel()).backward()
    return leaf.grad


def run(model, exact: bool, block: int):
    """The parameters' gradient of one response's weighted log-probs: whole replay (block 0) or in blocks."""
    prompt, response = ids(PROMPT, 0), ids(RESPONSE, 1)
    model.zero_grad(set_to_none=True)
    resident = model.capture(prompt, block_size=CAPTURE_BLOCK, boundaries=exact)
    state_grad = StateGrad(resident) if exact else None
    view = resident if state_grad is None else state_grad.replay_view(resident)
    if block:
        model.replay_blocks(view, response, loss_grad, block)
    else:
        loss_grad_R = loss_grad(model.logprobs(view, response).detach())
        (loss_grad_R * model.logprobs(view, response, grad=True)).sum().backward()
    if exact:
        model.prompt_backward(prompt, resident, state_grad, CAPTURE_BLOCK)
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def scores(model):
    prompt = ids(PROMPT, 0)
    responses = [ids(n, 30 + n) for n in (RESPONSE, 5, 11)]
    padded = torch.nn.utils.rnn.pad_sequence(responses, batch_first=True)
    resident = model.capture(prompt, block_size=CAPTURE_BLOCK)
    return model.score_blocks(resident, padded, BLOCK), [len(r) for r in responses]


def _worker(rank, world, port, out_dir):
    ep_group = join_gloo(rank, world, port).get(2, dist.group.WORLD)
    results = {}
    for name, model_name, lora, ep in CASES:
        model = make_model(model_name, lora)
        apply_context_parallel(model, dist.group.WORLD)
        if ep > 1:
            apply_expert_parallel(model, ep_group, cp_group=dist.group.WORLD)
        results[name] = {"response_only": run(model, False, BLOCK), "exact": run(model, True, BLOCK),
                         "scores": scores(model)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_blockwise_replay_under_context_parallel_equals_one_rank_whole_replay(tmp_path):
    results = rank_results(_worker, 2, tmp_path, timeout_s=400)
    torch.set_num_threads(1)
    for name, model_name, lora, ep in CASES:
        model = make_model(model_name, lora)
        for mode in ("response_only", "exact"):
            ref = run(model, mode == "exact", 0)
            for rank in range(2):
                err, _ = worst_rank_err(results[rank][name][mode], ref, rank, ep)
                print(f"cp=2 {name} {mode} block {BLOCK} rank {rank}: max rel err {err:.2e}")
                assert err <= TOL
        resident = model.capture(ids(PROMPT, 0), block_size=CAPTURE_BLOCK)
        for rank in range(2):
            got, lengths = results[rank][name]["scores"]
            for i, n in enumerate(lengths):
                ref = model.logprobs(resident, ids(n, 30 + n))
                assert rel_err(got[i, :n], ref) <= TOL


def ddp_problem(dp_rank):
    g = torch.Generator().manual_seed(100 + dp_rank)
    prompt = torch.randint(0, 259, (33,), generator=g)
    responses = [torch.randint(0, 259, (n,), generator=g) for n in (13, 8)]
    return prompt, responses, torch.tensor([0.1, 0.7])


def ddp_update(model, transactions):
    """The parameters' change made by `transactions()` (which ends with the optimizer's step)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    transactions()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def _ddp_worker(rank, world, port, out_dir):
    from longstraw_cli.distributed.strategy import DDPStrategy
    from longstraw_cli.rl.losses import LossConfig
    from longstraw_cli.transaction import Transaction, TransactionConfig

    join_gloo(rank, world, port)
    model = make_model("qwen36_tiny", None)
    strategy = DDPStrategy(model, lambda params: torch.optim.SGD(params, lr=1.0), None, dist.group.WORLD)
    tx = Transaction(model, strategy, LossConfig(name="grpo"), TransactionConfig(block_size=16, replay_block=5))
    prompt, responses, rewards = ddp_problem(rank)
    update = ddp_update(model, lambda: tx.run(prompt, responses, rewards, tx.capture(prompt)))
    torch.save(update, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_blockwise_replay_under_ddp_equals_one_process_average(tmp_path):
    """ddp with two data-parallel ranks: the blockwise replays run outside DDP's forward, and the one reduction
    after the last response (`sync_gradients`) gives each rank the one-process average of whole replays."""
    from longstraw_cli.distributed.local_strategy import LocalStrategy
    from longstraw_cli.rl.advantages import get_advantage
    from longstraw_cli.rl.losses import LossConfig
    from longstraw_cli.transaction import Transaction, TransactionConfig

    results = rank_results(_ddp_worker, 2, tmp_path, timeout_s=300)
    torch.set_num_threads(1)
    model = make_model("qwen36_tiny", None)
    tx = Transaction(model, LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=1.0), None),
                     LossConfig(name="grpo"), TransactionConfig(block_size=16))

    def both():
        for d in range(2):
            prompt, responses, rewards = ddp_problem(d)
            resident = tx.capture(prompt)
            tx.replay(resident, responses, tx.score(resident, responses), None,
                      get_advantage("grpo")(rewards.double()).tolist(), scale=0.5)
        tx.step()

    want = ddp_update(model, both)
    for rank in range(2):
        err = max(rel_err(results[rank][n], w) for n, w in want.items() if w.norm() > 0)
        print(f"ddp rank {rank}: blockwise update vs one-process whole replays, max rel err {err:.2e}")
        assert err <= TOL
