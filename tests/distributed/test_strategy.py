"""Gradient finalization strategies (ddp, fsdp2, deepspeed) on gloo CPU ranks, against one process that sums
both data-parallel ranks' gradients and averages them: parameters after two optimizer steps and grad norms, one
reduction per step and none during replays, context parallel underneath, LoRA, an unused parameter, resume from
a checkpoint, exact gradients (ddp reduces after the prompt's walk; under context parallel too), and
`longstraw train strategy=...` under torchrun.

The ranks run every case in one launch of forked ranks per layout (process start-up and the first DDP/FSDP import
cost more than the cases themselves); the tests then read what each case left."""

import collections
import contextlib
import copy
import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import randomize_, rel_err, run_ranks
from longstraw_cli.checkpoint import CheckpointManager, format_sharded, format_whole
from longstraw_cli.distributed.cp import apply_context_parallel
from longstraw_cli.distributed.strategy import DDPStrategy, LocalStrategy, StrategyConfig, make_strategy
from longstraw_cli.distributed.topology import ParallelDims
from longstraw_cli.lora import LoraConfig, apply_lora
from longstraw_cli.models import build_model
from longstraw_cli.resident.gradient import StateGrad
from longstraw_cli.rl.advantages import get_advantage
from longstraw_cli.rl.losses import LossConfig
from longstraw_cli.transaction import Transaction, TransactionConfig

# every case runs on forked gloo ranks or under torchrun
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

G, STEPS, MAX_GRAD_NORM = 3, 2, 0.5
TX = TransactionConfig(block_size=16)
EXACT_TX = TransactionConfig(block_size=16, gradient="exact")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = "deepspeed is not installed (pip install deepspeed, or the `deepspeed` extra)"
# in a module named as glm52's DSA indexer (base_weights.NO_GRADIENT_SCOPES): DDP searches for unused parameters
# only where such a module is trainable
UNUSED = "indexer.weight"

# name -> (strategy config, dtype, options); deepspeed keeps fp32 master weights, so its cases are fp32
CASES = {
    "ddp": (StrategyConfig("ddp"), torch.float64, {}),
    "fsdp2": (StrategyConfig("fsdp2"), torch.float64, {"resume": True}),
    # fsdp2's own checkpoints: sharded through torch.distributed.checkpoint, no whole tensor on any rank
    "fsdp2_sharded": (StrategyConfig("fsdp2"), torch.float64, {"resume": True, "sharded": True}),
    "deepspeed_zero1": (StrategyConfig("deepspeed", zero_stage=1), torch.float32, {}),
    "deepspeed_zero2": (StrategyConfig("deepspeed", zero_stage=2), torch.float32, {"resume": True}),
    # LoRA: only adapters train, plus one trainable parameter the loss never reaches (like glm52's DSA indexer)
    "ddp_lora": (StrategyConfig("ddp"), torch.float64, {"lora": True, "unused": True}),
    # control for the reduction counter: DDP synced in every replay must show reductions during replays
    "ddp_synced_every_replay": (StrategyConfig("ddp"), torch.float64, {"control": True, "steps": 1}),
    # capture.gradient=exact: the replays run unsynced, the prompt's walk follows, then `sync_gradients`
    "ddp_exact": (StrategyConfig("ddp"), torch.float64, {"exact": True}),
}
COUNTED = ("ddp", "fsdp2", "deepspeed_zero1", "deepspeed_zero2", "ddp_synced_every_replay")
CP_CASES = ("ddp", "fsdp2", "ddp_exact")


def make_model(dtype, lora=False, unused=False):
    model = build_model("qwen36_tiny", dtype=dtype)
    randomize_(model, seed=3)
    if lora:
        torch.manual_seed(5)
        apply_lora(model, LoraConfig(rank=4, target_modules=("q_proj", "out_proj", "down_proj")))
    if unused:
        # a trainable parameter the loss never reaches, like glm52's DSA indexer
        model.add_module("indexer", torch.nn.Module())
        model.indexer.register_parameter("weight", torch.nn.Parameter(torch.ones(4, dtype=dtype)))
    return model


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def problem(step: int, dp_rank: int):
    """Rank d's prompt at a step; lengths differ between ranks (a different number of capture blocks)."""
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    prompt = torch.randint(0, 259, (40 + 13 * dp_rank,), generator=g)
    responses = [torch.randint(0, 259, (5 + i + dp_rank,), generator=g) for i in range(G)]
    return prompt, responses, torch.rand(G, generator=g)


class Reductions(TorchDispatchMode):
    """Counts the gradient reductions (all-reduce, reduce-scatter) that run in each phase of a transaction."""

    def __init__(self):
        super().__init__()
        self.phase, self.counts = "other", collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d.") and ("allreduce" in name or "reduce_scatter" in name):
            self.counts[self.phase] += 1
        return func(*args, **(kwargs or {}))

    def watch(self, strategy):
        """Count inside the strategy's replays and finalize (the mode sees every op: capture and scoring stay out
        of it, they are slow enough)."""
        replay, finalize = strategy.replay, strategy.finalize

        @contextlib.contextmanager
        def counted_replay(index, count):
            self.phase = f"replay {index}"
            with self, replay(index, count) as logprobs:
                yield logprobs

        def counted_finalize():
            self.phase = "finalize"
            with self:
                return finalize()

        strategy.replay, strategy.finalize = counted_replay, counted_finalize


class SyncedEveryReplay(DDPStrategy):
    @contextlib.contextmanager
    def replay(self, index, count):
        yield self.ddp


def run(tx, step, dp_rank):
    prompt, responses, rewards = problem(step, dp_rank)
    return tx.run(prompt, responses, rewards, tx.capture(prompt))


def run_case(name, dims, rank, groups, out_dir):
    cfg, dtype, options = CASES[name]
    dp_rank, _ = dims.coords(rank)

    def build():
        model = make_model(dtype, lora=options.get("lora", False), unused=options.get("unused", False))
        if dims.cp > 1:
            apply_context_parallel(model, groups.cp)
        if options.get("control"):
            strategy = SyncedEveryReplay(model, adamw, MAX_GRAD_NORM, groups.dp)
        else:
            strategy = make_strategy(cfg, model, adamw, groups, max_grad_norm=MAX_GRAD_NORM, num_replays=G)
        return strategy, Transaction(model, strategy, LossConfig(name="grpo"), EXACT_TX if options.get("exact") else TX)

    strategy, tx = build()
    # the counter slows a step down: it watches only the cases that assert on it
    meter = Reductions()
    if name in COUNTED and dims.cp == 1:
        meter.watch(strategy)
    out = {"norms": [], "reductions": [], "strategy": strategy.name}
    for step in range(options.get("steps", STEPS)):
        meter.counts.clear()
        out["norms"].append(run(tx, step, dp_rank).stats["grad_norm"])
        out["reductions"].append(dict(meter.counts))
        if options.get("resume") and step == 0:
            checkpoints = CheckpointManager(out_dir / f"{name}_checkpoints", rank=rank)
            model_state, optimizer_state = strategy.state_dict()
            if options.get("sharded"):
                format_sharded.save(checkpoints, 1, strategy, {})
                # copies: AdamW's step counter is a live tensor the next step increments in place
                out["checkpointed"] = copy.deepcopy((model_state, optimizer_state))
            else:
                format_whole.save(checkpoints, 1, model_state=model_state, optimizer_state=optimizer_state,
                                  trainer_state={})
            dist.barrier()
    out["params"], _ = strategy.state_dict()
    if options.get("resume"):
        # a fresh model and strategy from the step-1 checkpoint, then step 2: as if the run had been killed
        strategy, tx = build()
        if options.get("sharded"):
            format_sharded.load(checkpoints.latest(), strategy)
        else:
            model_state, optimizer_state, _ = format_whole.load(checkpoints.latest())
            strategy.load_state_dict(model_state, optimizer_state)
        out["resumed_norm"] = run(tx, 1, dp_rank).stats["grad_norm"]
        out["resumed_params"], _ = strategy.state_dict()
    torch.save(out, out_dir / f"{name}.rank{rank}.pt")


def _worker(rank, world, port, cp, out_dir, names):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dims = ParallelDims(world, cp=cp)
        groups = dims.new_groups(rank)
        for name in names:
            run_case(name, dims, rank, groups, out_dir)
    finally:
        dist.destroy_process_group()


def launch(tmp_path_factory, world, cp, names):
    out_dir = tmp_path_factory.mktemp(f"world{world}_cp{cp}")
    run_ranks(_worker, world, cp, out_dir, names, timeout_s=600)

    def load(name, rank):
        return torch.load(out_dir / f"{name}.rank{rank}.pt")

    load.out_dir = out_dir
    return load


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    names = [n for n in CASES if HAS_DEEPSPEED or not n.startswith("deepspeed")]
    return launch(tmp_path_factory, 2, 1, names)


@pytest.fixture(scope="module")
def cp2_dp2(tmp_path_factory):
    return launch(tmp_path_factory, 4, 2, CP_CASES)


@functools.cache
def reference(dtype, lora=False, exact=False):
    """One process: per step, both data-parallel ranks' replays (and exact: prompt walks) accumulate, the sum is
    halved, then clip and step."""
    torch.set_num_threads(1)
    model = make_model(dtype, lora=lora)
    strategy = LocalStrategy(model, adamw([p for p in model.parameters() if p.requires_grad]), MAX_GRAD_NORM)
    cfg = EXACT_TX if exact else TX
    tx = Transaction(model, strategy, LossConfig(name="grpo"), cfg)
    norms = []
    for step in range(STEPS):
        tx.strategy.zero_grad()
        for d in range(2):
            prompt, responses, rewards = problem(step, d)
            resident = tx.capture(prompt)
            advantages = get_advantage(cfg.advantage)(rewards.double()).tolist()
            state_grad = StateGrad(resident) if exact else None
            tx.replay(resident, responses, tx.score(resident, responses), None, advantages, state_grad)
            if exact:
                model.prompt_backward(prompt, resident, state_grad, cfg.block_size)
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= 2
        norms.append(tx.finalize())
        tx.step()
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, norms


def compare(name, got, dtype, lora=False, exact=False):
    """(worst parameter rel err, worst update rel err) against the one-process average; asserts the norms."""
    want, want_norms = reference(dtype, lora, exact)
    start = make_model(dtype, lora=lora)
    err = update = 0.0
    for n, w in want.items():
        err = max(err, rel_err(got["params"][n], w))
        moved = start.get_parameter(n).detach()
        update = max(update, rel_err(got["params"][n] - moved, w - moved))
    print(f"{name}: parameters rel err {err:.1e}, updates rel err {update:.1e}, grad norms {got['norms']} "
          f"vs {want_norms}")
    assert want_norms[0] > MAX_GRAD_NORM, "clipping must be active for the test to cover it"
    return err, update, want_norms


# fp64: DDP and FSDP2 differ from the one-process sum only in the order of additions (~1e-15); deepspeed runs fp32
TOLERANCE = {torch.float64: (1e-12, 1e-10, 1e-12), torch.float32: (2e-5, 2e-4, 1e-5)}


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "deepspeed_zero1", "deepspeed_zero2", "ddp_lora", "ddp_exact"])
def test_two_data_parallel_ranks_equal_one_process_average(dp2, name):
    if name.startswith("deepspeed") and not HAS_DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)
    cfg, dtype, options = CASES[name]
    params_tol, update_tol, norm_tol = TOLERANCE[dtype]
    for rank in range(2):
        got = dp2(name, rank)
        assert got["strategy"] == cfg.name
        err, update, want_norms = compare(f"{name} rank {rank}", got, dtype, lora=options.get("lora", False),
                                          exact=options.get("exact", False))
        assert err <= params_tol and update <= update_tol
        assert got["norms"] == pytest.approx(want_norms, rel=norm_tol)


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "deepspeed_zero1", "deepspeed_zero2"])
def test_one_reduction_per_step_and_none_during_replays(dp2, name):
    if name.startswith("deepspeed") and not HAS_DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)
    counts = dp2(name, 0)["reductions"]
    print(f"{name}: reductions by phase per step {counts}")
    for step in counts:
        assert all(step.get(f"replay {i}", 0) == 0 for i in range(G - 1)), step
        assert step.get(f"replay {G - 1}", 0) + step.get("finalize", 0) > 0, step
    # once per step, one per bucket / layer group: the same number each step; DDP alone may differ between step 0
    # and step 1, since it rebuilds its buckets once after step 0 in the order the gradients arrived (it skips
    # that only when searching for unused parameters, which it no longer does here)
    if name != "ddp":
        assert counts[0] == counts[1], counts
    # the counter sees DDP's reductions inside a replay's backward when they are there
    control = dp2("ddp_synced_every_replay", 0)["reductions"]
    assert all(control[0].get(f"replay {i}", 0) > 0 for i in range(G)), control


def test_exact_gradients_differ_from_response_only(dp2):
    """The ddp_exact case above is not response_only under another name: the prompt's gradient moved it."""
    err = max(rel_err(dp2("ddp_exact", 0)["params"][n], p) for n, p in dp2("ddp", 0)["params"].items())
    assert err > 1e-6


def test_ddp_with_lora_trains_adapters_only_and_tolerates_a_parameter_without_gradient(dp2):
    got = dp2("ddp_lora", 0)
    assert all(".lora_" in n for n in got["params"] if n != UNUSED)
    assert torch.equal(got["params"][UNUSED], torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_sharded", "deepspeed_zero2"])
def test_resume_from_checkpoint_equals_uninterrupted_run(dp2, name):
    if name.startswith("deepspeed") and not HAS_DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)
    for rank in range(2):
        got = dp2(name, rank)
        diff = max((got["resumed_params"][n] - p).abs().max().item() for n, p in got["params"].items())
        print(f"{name} rank {rank}: resumed vs uninterrupted max abs diff {diff:.1e}")
        assert diff == 0.0 and got["resumed_norm"] == got["norms"][1]


def test_sharded_fsdp2_checkpoint_loads_in_one_process(dp2, tmp_path_factory):
    """Written by two fsdp2 ranks (each its own shards: no whole tensor gathered), read by one process with no
    process group: DCP reshards, and the weights and AdamW moments are the ones the two ranks held."""
    [path] = CheckpointManager(dp2.out_dir / "fsdp2_sharded_checkpoints").complete()
    assert sorted(p.name for p in (path / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (path / "model.safetensors").exists()
    model = make_model(torch.float64)
    strategy = LocalStrategy(model, adamw([p for p in model.parameters() if p.requires_grad]), MAX_GRAD_NORM)
    format_sharded.load(path, strategy)
    want_model, want_optimizer = dp2("fsdp2_sharded", 0)["checkpointed"]
    got_model, got_optimizer = strategy.state_dict()
    assert set(got_model) == set(want_model)
    assert all(torch.equal(got_model[n], want_model[n]) for n in want_model)
    for i, state in want_optimizer["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got_optimizer["state"][i][key], state[key]), (i, key)


@pytest.mark.parametrize("name", CP_CASES)
def test_context_parallel_under_data_parallel_equals_dp2_cp1(dp2, cp2_dp2, name):
    for rank in range(4):
        got, want = cp2_dp2(name, rank), dp2(name, 0)
        err = max(rel_err(got["params"][n], w) for n, w in want["params"].items())
        print(f"{name} cp=2 x dp=2 rank {rank}: parameters rel err {err:.1e} vs dp=2, grad norms {got['norms']} "
              f"vs {want['norms']}")
        assert err <= 1e-10
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-10)


# ddp, the default, and fsdp2 (its sharded checkpoint resumed in one process) run under torchrun in
# tests/e2e/test_cli.py (test_torchrun_ranks_share_one_run_dir)
def test_longstraw_train_under_deepspeed_with_torchrun(tmp_path):
    if not HAS_DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)
    run = tmp_path / "run"
    args = ["strategy=deepspeed", "prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[console]",
            "steps=1", f"run_dir={run}"]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "longstraw_cli", "train", *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    log = (run / "train_rank1.log").read_text()
    assert "strategy deepspeed" in log and "rank 1 step 0 " in log
    assert (run / "checkpoints" / "step_00000001" / "COMPLETE").exists()
