"""Checkpoints under expert parallel (gloo, 8 CPU ranks; glm52_tiny with 16 experts, 2 a rank): each rank writes
only its experts and their AdamW moments, at their global expert index, through torch.distributed.checkpoint
(checkpoint/format_sharded.py); the replicated tensors are written once. A run trained 2 steps under ep=8,
checkpointed, and resumed for 2 more under ep=8 (bit-exactly), ep=4 and one process (the checkpoint reads back
bit-exactly; the steps after it are the uninterrupted run's up to the order in which the grad norm adds the
experts' slices) ends where the uninterrupted ep=8 run ends. While saving, a rank allocates at most one tensor
beyond the state it holds (its share). A whole-tensor checkpoint of every expert, written by one process (ep=1),
still loads under ep=8. A NaN in one rank's experts is found by every rank (so all refuse the save alike). The
trainer's path (ep=2 -> ep=2 / ep=1 under torchrun) is tests/e2e/test_cli.py's.

The 8 ranks are forked once (the module's fixture), one intra-op thread each, and every resume under ep > 1 runs
in them; the one-process parts (the ep=1 checkpoint, the resume in one process) run in the test process, once:
on a 2-core machine the ranks make every replicated step eight times."""

import math
import os
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import join_gloo, random_model, rel_err, run_ranks
from longstraw_cli import checkpoint
from longstraw_cli.checkpoint import CheckpointManager, format_whole
from longstraw_cli.checkpoint.integrity import first_nonfinite
from longstraw_cli.distributed.ep import apply_expert_parallel, expert_bounds, is_expert_param
from longstraw_cli.distributed.local_strategy import LocalStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD, BLOCK = 8, 16
# glm52_tiny's 8 experts made 16: two a rank under ep=8, four under ep=4
EXPERTS = 16
# trained before the checkpoint, and in all
SAVED_AT, STEPS = 2, 4
NAN_IN = "model.layers.3.mlp.experts.down_proj"


def build(ep_group, seed):
    """glm52_tiny with EXPERTS experts and every weight random, its experts split over `ep_group` (None: all
    here)."""
    model = random_model("glm52_tiny", torch.float64, seed=seed, n_routed_experts=EXPERTS)
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


def train(strategy, steps) -> list[float]:
    return [train_step(strategy, step) for step in steps]


def resume(path, strategy) -> None:
    """The checkpoint at `path` into `strategy` through the package's one entry point, as the trainer resumes."""
    checkpoint.load(path, strategy, config={}, map_location="cpu")


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


def local_tensors(state) -> list[torch.Tensor]:
    """The tensors of a (nested) sharded state dict as this rank holds them: DTensors by their local part."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return [t for v in state.values() for t in local_tensors(v)]
    if isinstance(state, DTensor):
        return [state.to_local()]
    return [state] if isinstance(state, torch.Tensor) else []


class Allocations(TorchDispatchMode):
    """The tensors ops make while active: the largest one (elements of a floating-point tensor), and the peak of
    the bytes of those alive at once. A storage counts from the op that makes it until the last tensor on it that
    an op returned is freed; views and in-place results, on a storage already there, count nothing. Not counted:
    uint8 tensors, which here are pickled Python objects on their way through gloo (DCP's plans and metadata,
    whose size grows with the number of tensors, not with their bytes: ~40 KB a rank here), and file buffers."""

    def __init__(self):
        super().__init__()
        self.numel, self.live, self.peak = 0, 0, 0
        # storage address -> [bytes, tensors on it alive]
        self._storages = {}

    def _freed(self, ptr):
        entry = self._storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        def storages(xs):
            return {x.untyped_storage().data_ptr() for x in xs if isinstance(x, torch.Tensor)
                    and not isinstance(x, DTensor) and x.untyped_storage().nbytes()}

        inputs = storages(torch.utils._pytree.tree_leaves((args, kwargs)))
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            t_local = t._local_tensor if isinstance(t, DTensor) else t
            if t_local.dtype == torch.uint8:
                continue
            if t_local.is_floating_point():
                self.numel = max(self.numel, t_local.numel())
            ptr = t_local.untyped_storage().data_ptr()
            if not t_local.untyped_storage().nbytes() or (ptr in inputs and ptr not in self._storages):
                continue
            if ptr not in self._storages:
                self._storages[ptr] = [t_local.untyped_storage().nbytes(), 0]
                self.live += self._storages[ptr][0]
                self.peak = max(self.peak, self.live)
            self._storages[ptr][1] += 1
            weakref.finalize(t_local, self._freed, ptr)
        return out


def _worker(rank, world, port, out_dir):
    join_gloo(rank, world, port)
    # ep=4: two EP groups of four ranks, each expert held twice (every rank creates both: a collective)
    quad = dist.new_subgroups(group_size=4)[0]
    out = {}

    strategy = build(dist.group.WORLD, seed=3)
    out["norms"] = train(strategy, range(SAVED_AT))
    state = strategy.sharded_state_dict()
    own = {n: p for n, p in strategy.model.named_parameters() if is_expert_param(n)}
    # the state DCP writes holds this rank's rows of each expert tensor, the live ones (no copy), at global rows
    out["expert_entries"] = {
        n: (tuple(t.to_local().shape), tuple(t.shape), t.to_local().data_ptr() == own[n].data_ptr())
        for n, t in state["model"].items() if n in own}
    out["own_shapes"] = {n: tuple(p.shape) for n, p in own.items()}
    # the rank's share: every tensor of the state it holds (weights, buffers, AdamW state); the state dict copies
    # none of them
    held = [*strategy.model.parameters(), *strategy.model.buffers(),
            *(v for s in strategy.optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    held_storages = {t.untyped_storage().data_ptr() for t in held}
    out["share_bytes"] = sum(t.nbytes for t in held)
    out["state_copies"] = [tuple(t.shape) for t in local_tensors(state)
                           if t.untyped_storage().data_ptr() not in held_storages]
    out["largest_held"] = max(p.numel() for p in strategy.model.parameters())
    out["largest_held_bytes"] = max(t.nbytes for t in held)
    del state
    # what the trainer calls: the finite check, then the format the strategy's state dicts take
    with Allocations() as made:
        path = checkpoint.save(CheckpointManager(os.path.join(out_dir, "run"), rank=rank), SAVED_AT, strategy, {})
    out["largest_saved"], out["peak_saved_bytes"] = made.numel, made.peak
    out["saved"] = whole_state(strategy)
    out["norms"] += train(strategy, range(SAVED_AT, STEPS))
    out["after"] = whole_state(strategy)

    # resumed under the same ep=8 from another start: bit for bit the uninterrupted run
    strategy = build(dist.group.WORLD, seed=4)
    resume(path, strategy)
    out["ep8_norms"], out["ep8_after"] = train(strategy, range(SAVED_AT, STEPS)), whole_state(strategy)
    # resumed under ep=4
    strategy = build(quad, seed=4)
    resume(path, strategy)
    out["ep4_loaded"] = whole_state(strategy)
    out["ep4_norms"], out["ep4_after"] = train(strategy, range(SAVED_AT, STEPS)), whole_state(strategy)
    # and saved under ep=4: each expert is held by two ranks, one writes it
    checkpoint.save(CheckpointManager(os.path.join(out_dir, "run_ep4"), rank=rank), STEPS, strategy, {})

    # the whole-tensor checkpoint of every expert the test process wrote (ep=1) loads under ep=8: each rank its
    # rows. The whole format holds the trainable weights, not the buffers (the router's bias): built as the run
    # built them
    strategy = build(dist.group.WORLD, seed=3)
    resume(CheckpointManager(os.path.join(out_dir, "run_whole")).latest(), strategy)
    out["whole_loaded"] = whole_state(strategy)
    out["whole_own_rows"] = {n: tuple(p.shape) for n, p in strategy.model.named_parameters() if is_expert_param(n)}

    # a NaN in one rank's experts: every rank finds it (the check before a save), so all stop alike
    if rank == WORLD - 1:
        with torch.no_grad():
            dict(strategy.model.named_parameters())[NAN_IN][0, 0, 0] = float("nan")
    out["nonfinite"] = first_nonfinite(strategy.sharded_model_state())
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, one_thread):
    """(out_dir, each rank's results, the whole-tensor checkpoint's state). The test process writes the ep=1
    checkpoint (2 steps, every expert whole) first; the 8 ranks then run `_worker` once."""
    out_dir = tmp_path_factory.mktemp("ep_checkpoint")
    whole = build(None, seed=3)
    train(whole, range(SAVED_AT))
    model_state, optimizer_state = whole.state_dict()
    format_whole.save(CheckpointManager(out_dir / "run_whole", rank=0), SAVED_AT, model_state=model_state,
                      optimizer_state=optimizer_state, trainer_state={})
    whole_saved = whole_state(whole)
    del whole, model_state, optimizer_state
    run_ranks(_worker, WORLD, str(out_dir), timeout_s=600)
    return out_dir, [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)], whole_saved


def test_each_rank_hands_dcp_only_its_own_experts_and_allocates_no_whole_one(saved):
    _, results, _ = saved
    for rank, got in enumerate(results):
        assert got["expert_entries"], "no expert parameter in the sharded state dict"
        for name, (local, whole, shares) in got["expert_entries"].items():
            assert local == got["own_shapes"][name] and shares, (rank, name)
            assert whole == (WORLD * local[0], *local[1:]) and local[0] == EXPERTS // WORLD
        whole_expert = max(math.prod(whole) for _, whole, _ in got["expert_entries"].values())
        print(f"rank {rank}: largest tensor made while saving {got['largest_saved']} elements, largest held "
              f"{got['largest_held']}, a whole expert tensor {whole_expert}")
        # a gather of any expert tensor would make one of all E rows; nothing made is larger than a tensor held
        assert got["largest_saved"] <= got["largest_held"] < whole_expert


def test_a_rank_saving_allocates_at_most_its_share_plus_one_tensor(saved):
    """The sharded state dict wraps the live tensors (no copy), and the save (finite check, DCP's write) never
    holds more than one tensor's bytes beyond them at once."""
    _, results, _ = saved
    for rank, got in enumerate(results):
        print(f"rank {rank}: share {got['share_bytes']} B; while saving at most {got['peak_saved_bytes']} B more "
              f"alive at once (largest tensor held {got['largest_held_bytes']} B)")
        assert got["state_copies"] == [], (rank, got["state_copies"])
        assert 0 < got["peak_saved_bytes"] <= got["largest_held_bytes"] < got["share_bytes"]


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
            assert index.offset[0] == expert_bounds(EXPERTS, ep, writer % ep)[0], (index, info.relative_path)
            experts[info.relative_path] += tensor_bytes
        else:
            replicated[info.relative_path] += tensor_bytes
    # what a file holds beyond tensor bytes is torch.save's framing
    assert written == {f: (path / "dcp" / f).stat().st_size for f in files}
    return written, experts, replicated


def test_each_rank_writes_its_share_and_replicated_tensors_once(saved):
    out_dir, results, _ = saved
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
    # under ep=4 every expert is on two ranks: written once too, by one of them
    [path] = CheckpointManager(out_dir / "run_ep4").complete()
    written, experts, replicated = bytes_by_file(path, ep=4)
    print(f"ep=4: bytes per rank file {written}: experts {experts}, replicated {replicated}")
    assert sum(experts.values()) == want_experts and sum(replicated.values()) == want_replicated
    assert all(b <= want_experts // 4 for b in experts.values())


def test_ep8_run_resumed_under_ep8_ep4_and_one_process_ends_as_the_uninterrupted_run(saved, one_thread):
    out_dir, results, _ = saved
    [path] = CheckpointManager(out_dir / "run").complete()
    want = results[0]["saved"]
    # one process, no process group: every expert whole, read from the eight ranks' files
    strategy = build(None, seed=5)
    resume(path, strategy)
    one = whole_state(strategy)
    one_norms, one_after = train(strategy, range(SAVED_AT, STEPS)), whole_state(strategy)
    assert set(one) == set(want) and any(n.endswith("exp_avg_sq") and is_expert_entry(n) for n in want)
    for rank, got in enumerate(results):
        assert len(got["norms"]) == STEPS and all(n > 0 for n in got["norms"])
        # the same ep: the same arithmetic, bit for bit
        assert got["ep8_norms"] == got["norms"][SAVED_AT:], rank
        assert all(torch.equal(got["ep8_after"][n], got["after"][n]) for n in want), rank
        # another ep reads the checkpoint back bit for bit
        for loaded in (got["ep4_loaded"], one):
            assert all(torch.equal(loaded[n], want[n]) for n in want), rank
        # the steps after it: the uninterrupted run's, up to the rounding of a different all-reduce over the experts
        # (the grad norm's squared partial sums: ep=8 adds eight, ep=4 four, one process none)
        for where, norms, after in (("ep=4", got["ep4_norms"], got["ep4_after"]),
                                    ("one process", one_norms, one_after)):
            assert norms == pytest.approx(got["norms"][SAVED_AT:], rel=1e-12)
            norm_err = max(abs(a / b - 1) for a, b in zip(norms, got["norms"][SAVED_AT:]))
            err = max(rel_err(after[n], got["after"][n]) for n in want)
            print(f"rank {rank}: resumed under {where}, grad norms within {norm_err:.1e}, parameters and moments "
                  f"after step {STEPS - 1} within {err:.1e} of the uninterrupted ep=8 run")
            assert err < 1e-12
    # the ep=4 checkpoint of the last step, in one process: what the ep=4 ranks held
    strategy = build(None, seed=5)
    resume(CheckpointManager(out_dir / "run_ep4").latest(), strategy)
    one = whole_state(strategy)
    assert all(torch.equal(one[n], results[0]["ep4_after"][n]) for n in want)


def test_a_whole_tensor_checkpoint_of_every_expert_loads_under_ep(saved):
    _, results, want = saved
    for rank, got in enumerate(results):
        assert set(got["whole_loaded"]) == set(want)
        assert all(torch.equal(got["whole_loaded"][n], want[n]) for n in want), rank
        assert all(rows[0] == EXPERTS // WORLD for rows in got["whole_own_rows"].values())


def test_a_nonfinite_expert_on_one_rank_is_found_on_every_rank(saved):
    _, results, _ = saved
    assert [got["nonfinite"] for got in results] == [NAN_IN] * WORLD
