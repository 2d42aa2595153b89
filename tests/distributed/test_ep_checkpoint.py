"""Checkpoints under expert parallel (gloo, 4 CPU ranks): each rank writes only its experts and their AdamW
moments, at their global expert index, through torch.distributed.checkpoint (checkpoint/format_sharded.py);
the replicated tensors are written once; a checkpoint saved under ep=4 loads bit-exactly under ep=2 and under one
process, and the step after it equals the uninterrupted ep=4 run's. No tensor larger than a rank's own is made
while saving; a NaN in one rank's experts is found by every rank (so all refuse the save alike). The trainer's
path (ep=2 -> ep=2 / ep=1 under torchrun) is tests/e2e/test_cli.py's."""

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import join_gloo, random_model, rel_err, run_ranks
from longstraw_cli.checkpoint import CheckpointManager, format_sharded
from longstraw_cli.checkpoint.integrity import first_nonfinite
from longstraw_cli.distributed.ep import apply_expert_parallel, expert_bounds, is_expert_param
from longstraw_cli.distributed.local_strategy import LocalStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD, BLOCK = 4, 16
NAN_IN = "model.layers.3.mlp.experts.down_proj"


def build(ep_group, seed):
    """glm52_tiny (8 experts) with every weight random, its experts split over `ep_group` (None: all here)."""
    model = random_model("glm52_tiny", torch.float64, seed=seed)
    if ep_group is not None:
        apply_expert_parallel(model, ep_group, cp_group=dist.group.WORLD)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return LocalStrategy(model, optimizer, max_grad_norm=1.0, ep_group=ep_group)


def train_step(strategy, step):
    """One optimizer step on a seeded prompt and response, the same on every rank (replicated tokens) -> norm."""
    g = torch.Generator().manual_seed(step)
    prompt, response = torch.randint(0, 259, (40,), generator=g), torch.randint(0, 259, (6,), generator=g)
    model = strategy.model
    resident = model.capture(prompt, block_size=BLOCK)
    model.logprobs(resident, response, grad=True).sum().backward()
    norm = strategy.finalize()
    strategy.step()
    return norm


def is_expert_entry(key: str) -> bool:
    """Whether a checkpoint key (a weight, or its AdamW moment) is of a routed-expert parameter."""
    return is_expert_param(key.removesuffix(".exp_avg").removesuffix(".exp_avg_sq"))


def whole_state(strategy):
    """Copies of what a checkpoint holds, by name, whole (expert slices gathered: a test's view only): weights,
    AdamW state, and the buffers saved with the weights (the router's bias)."""
    model_state, optimizer_state = strategy.state_dict()
    names = list(model_state)
    moments = {f"{names[int(i)]}.{k}": v for i, s in optimizer_state["state"].items() for k, v in s.items()}
    params = dict(strategy.model.named_parameters())
    buffers = {n: t for n, t in strategy.model.state_dict().items() if n not in params}
    return {n: t.clone() for n, t in {**model_state, **moments, **buffers}.items()}


class LargestAllocation(TorchDispatchMode):
    """The most elements of any floating-point tensor an op makes while active (DCP's pickled plans, bytes,
    are not counted)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.numel = max(self.numel, t.numel())
        return out


def _worker(rank, world, port, out_dir):
    pair = join_gloo(rank, world, port)[2]
    checkpoints = CheckpointManager(os.path.join(out_dir, "run"), rank=rank)
    out = {}

    strategy = build(dist.group.WORLD, seed=3)
    train_step(strategy, 0)
    state = strategy.sharded_state_dict()
    own = {n: p for n, p in strategy.model.named_parameters() if is_expert_param(n)}
    # the state DCP writes holds this rank's rows of each expert tensor, the live ones (no copy), at global rows
    out["expert_entries"] = {
        n: (tuple(t.to_local().shape), tuple(t.shape), t.to_local().data_ptr() == own[n].data_ptr())
        for n, t in state["model"].items() if n in own}
    out["own_shapes"] = {n: tuple(p.shape) for n, p in own.items()}
    with LargestAllocation() as largest:
        path = format_sharded.save(checkpoints, 1, strategy, {})
    out["largest_saved"] = largest.numel
    out["largest_held"] = max(p.numel() for p in strategy.model.parameters())
    out["saved"] = whole_state(strategy)
    out["norm"] = train_step(strategy, 1)
    out["after"] = whole_state(strategy)

    # resumed under ep=2 (two EP groups of two ranks: each expert held twice) from another start
    strategy = build(pair, seed=4)
    format_sharded.load(path, strategy)
    out["ep2_loaded"] = whole_state(strategy)
    out["ep2_norm"] = train_step(strategy, 1)
    out["ep2_after"] = whole_state(strategy)
    # and saved under ep=2: each expert is held by two ranks, one writes it
    format_sharded.save(CheckpointManager(os.path.join(out_dir, "run_ep2"), rank=rank), 2, strategy, {})
    # a NaN in one rank's experts: every rank finds it (the trainer's check before a save), so all stop alike
    if rank == WORLD - 1:
        with torch.no_grad():
            dict(strategy.model.named_parameters())[NAN_IN][0, 0, 0] = float("nan")
    out["nonfinite"] = first_nonfinite(strategy.sharded_model_state())
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ep_checkpoint")
    run_ranks(_worker, WORLD, str(out_dir), timeout_s=300)
    return out_dir, [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def test_each_rank_hands_dcp_only_its_own_experts_and_allocates_no_whole_one(saved):
    _, results = saved
    for rank, got in enumerate(results):
        assert got["expert_entries"], "no expert parameter in the sharded state dict"
        for name, (local, whole, shares) in got["expert_entries"].items():
            assert local == got["own_shapes"][name] and shares, (rank, name)
            assert whole == (WORLD * local[0], *local[1:]) and local[0] == 8 // WORLD
        whole_expert = max(math.prod(whole) for _, whole, _ in got["expert_entries"].values())
        print(f"rank {rank}: largest tensor made while saving {got['largest_saved']} elements, largest held "
              f"{got['largest_held']}, a whole expert tensor {whole_expert}")
        # a gather of any expert tensor would make one of all E rows; nothing made is larger than a tensor held
        assert got["largest_saved"] <= got["largest_held"] < whole_expert


def bytes_by_file(path, ep: int) -> tuple[dict, dict, dict]:
    """Per DCP file of checkpoint `path`: (bytes written, tensor bytes of experts, of everything else). Checks
    that the files hold what the metadata lists, and that expert rows were written by a rank holding them (EP
    groups of `ep` consecutive ranks)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path / "dcp")).read_metadata()
    files = sorted(p.name for p in (path / "dcp").glob("*.distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(WORLD)]
    written, experts, replicated = ({f: 0 for f in files} for _ in range(3))
    for index, info in metadata.storage_data.items():
        written[info.relative_path] += info.length
        entry = metadata.state_dict_metadata[index.fqn]
        if not isinstance(entry, TensorStorageMetadata):
            continue
        [chunk] = [c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset)]
        tensor_bytes = chunk.sizes.numel() * entry.properties.dtype.itemsize
        if is_expert_entry(index.fqn):
            writer = int(info.relative_path[2])
            assert index.offset[0] == expert_bounds(8, ep, writer % ep)[0], (index, info.relative_path)
            experts[info.relative_path] += tensor_bytes
        else:
            replicated[info.relative_path] += tensor_bytes
    # what a file holds beyond tensor bytes is torch.save's framing
    assert written == {f: (path / "dcp" / f).stat().st_size for f in files}
    return written, experts, replicated


def test_each_rank_writes_its_share_and_replicated_tensors_once(saved):
    out_dir, results = saved
    [path] = CheckpointManager(out_dir / "run").complete()
    written, experts, replicated = bytes_by_file(path, ep=WORLD)
    want = results[0]["saved"]
    want_experts = sum(t.nbytes for n, t in want.items() if is_expert_entry(n))
    want_replicated = sum(t.nbytes for n, t in want.items() if not is_expert_entry(n))
    print(f"ep={WORLD}: bytes per rank file {written}: experts {experts}, replicated {replicated}; one copy of "
          f"everything: {want_experts} expert and {want_replicated} replicated bytes")
    # each rank its share of the experts; every replicated tensor once, over all files
    assert all(b == want_experts // WORLD for b in experts.values())
    assert sum(replicated.values()) == want_replicated
    # under ep=2 every expert is on two ranks: written once too, by one of them
    [path] = CheckpointManager(out_dir / "run_ep2").complete()
    written, experts, replicated = bytes_by_file(path, ep=2)
    print(f"ep=2: bytes per rank file {written}: experts {experts}, replicated {replicated}")
    assert sum(experts.values()) == want_experts and sum(replicated.values()) == want_replicated
    assert all(b <= want_experts // 2 for b in experts.values())


def test_ep4_checkpoint_resumes_bit_exactly_under_ep2_and_one_process(saved):
    out_dir, results = saved
    [path] = CheckpointManager(out_dir / "run").complete()
    want = results[0]["saved"]
    # one process, no process group: every expert whole, read from the four ranks' files
    strategy = build(None, seed=5)
    format_sharded.load(path, strategy)
    one = whole_state(strategy)
    one_norm = train_step(strategy, 1)
    one_after = whole_state(strategy)
    assert set(one) == set(want) and any(n.endswith("exp_avg_sq") and is_expert_entry(n) for n in want)
    for rank, got in enumerate(results):
        for loaded in (got["ep2_loaded"], one):
            assert all(torch.equal(loaded[n], want[n]) for n in want), rank
        # the step after: the uninterrupted ep=4 run's, up to the rounding of a different all-reduce
        for norm, after in ((got["ep2_norm"], got["ep2_after"]), (one_norm, one_after)):
            assert norm == pytest.approx(got["norm"], rel=1e-12)
            assert max(rel_err(after[n], got["after"][n]) for n in want) < 1e-12
    # the ep=2 checkpoint of that step, in one process: what the ep=2 ranks held
    strategy = build(None, seed=5)
    format_sharded.load(CheckpointManager(out_dir / "run_ep2").latest(), strategy)
    one = whole_state(strategy)
    assert all(torch.equal(one[n], results[0]["ep2_after"][n]) for n in want)


def test_a_nonfinite_expert_on_one_rank_is_found_on_every_rank(saved):
    _, results = saved
    assert [got["nonfinite"] for got in results] == [NAN_IN] * WORLD
