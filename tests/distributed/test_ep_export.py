"""export_hf under expert parallel (gloo, 4 CPU ranks): the EP group holding rank 0 writes the glm_moe_dsa
directory, each rank its own experts' per-expert keys (global index) into its own shards, rank 0 the replicated
tensors, config.json and the index. The directory written under ep=4 and under ep=2 (two EP groups: the second
writes nothing) holds exactly the tensors of the one-process export, and transformers loads it with our logits.
No rank forms a tensor beyond one expert's matrix while exporting, and no rank writes another's experts."""

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import join_gloo, run_ranks, tie_free_glm
from longstraw_cli import export
from longstraw_cli.distributed.ep import apply_expert_parallel, expert_bounds
from longstraw_cli.models.loading import INDEX

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD, EXPERTS = 4, 8
# glm52_tiny in fp32 is ~0.6 MB: shards of 60 KB give each rank several files
SHARD_BYTES = 60_000
EXPERT_KEY = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class LargestAllocation(TorchDispatchMode):
    """The most elements of any floating-point tensor an op makes in new memory while active: views and detached
    aliases of a tensor held (whose storage an input of the op has) and meta tensors (shapes only) are not
    counted."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta" \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.numel = max(self.numel, t.numel())
        return out


def _export(model, path, group):
    """export_hf on this rank -> (whether it wrote, {file: {key: shape}} it handed to save_file, largest tensor
    made)."""
    handed, save_file = {}, export.save_file

    def recording(tensors, filename, metadata=None):
        handed[os.path.basename(filename)] = {k: tuple(t.shape) for k, t in tensors.items()}
        save_file(tensors, filename, metadata=metadata)

    export.save_file = recording
    try:
        with LargestAllocation() as largest:
            out = export.export_hf(model, path, group=group, max_shard_bytes=SHARD_BYTES)
    finally:
        export.save_file = save_file
    return out is not None, handed, largest.numel


def _worker(rank, world, port, out_dir):
    pair = join_gloo(rank, world, port)[2]
    out = {}
    model = tie_free_glm()
    apply_expert_parallel(model, dist.group.WORLD, cp_group=dist.group.WORLD)
    out["held"] = {n: p.numel() for n, p in model.named_parameters() if "experts" in n}
    out["ep4"] = _export(model, os.path.join(out_dir, "ep4"), dist.group.WORLD)
    model = tie_free_glm()
    apply_expert_parallel(model, pair, cp_group=dist.group.WORLD)
    out["ep2"] = _export(model, os.path.join(out_dir, "ep2"), pair)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ep_export")
    run_ranks(_worker, WORLD, str(out_dir), timeout_s=300)
    one = export.export_hf(tie_free_glm(), out_dir / "one", max_shard_bytes=SHARD_BYTES)
    return out_dir, one, [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, each file opened; the index must name exactly these keys and files."""
    index = json.loads((path / INDEX).read_text())["weight_map"]
    found, files = {}, {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(str(path / file), framework="pt") as f:
                for key in f.keys():
                    found[key], files[key] = f.get_tensor(key), file
    assert files == index
    return found


@pytest.mark.parametrize("ep", [4, 2])
def test_the_directory_holds_the_one_process_exports_tensors(exported, ep):
    out_dir, one, _ = exported
    want, got = tensors(one), tensors(out_dir / f"ep{ep}")
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    assert (out_dir / f"ep{ep}" / "config.json").read_text() == (one / "config.json").read_text()
    shards = sorted(f for f in os.listdir(out_dir / f"ep{ep}") if f.endswith(".safetensors"))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]


def test_transformers_loads_the_ep_export_with_our_logits(exported):
    transformers = pytest.importorskip("transformers")
    out_dir, _, _ = exported
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(out_dir / "ep4").eval()
    ids = torch.randint(0, 259, (80,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (hf(ids[None]).logits[0] - tie_free_glm()(ids[None])[0]).abs().max().item()
    print(f"ep=4 export in transformers vs our one-process model: max abs logit err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("ep", [4, 2])
def test_each_rank_writes_only_its_experts_and_forms_no_whole_expert_tensor(exported, ep):
    out_dir, _, results = exported
    cfg = tie_free_glm().config
    one_matrix = cfg.moe_intermediate_size * cfg.hidden_size
    index = json.loads((out_dir / f"ep{ep}" / INDEX).read_text())["weight_map"]
    written = set()
    for rank, got in enumerate(results):
        returned, handed, largest = got[f"ep{ep}"]
        whole_expert = EXPERTS * max(got["held"].values()) // (EXPERTS // WORLD)
        print(f"ep={ep} rank {rank}: {len(handed)} files, {sum(map(len, handed.values()))} keys; largest tensor "
              f"formed {largest} elements (one expert's matrix {one_matrix}, a whole expert tensor {whole_expert})")
        if rank >= ep:
            # the second EP group holds the same weights: it writes nothing
            assert not returned and not handed and largest == 0
            continue
        lo, hi = expert_bounds(EXPERTS, ep, rank)
        for file, keys in handed.items():
            assert all(index[k] == file for k in keys)
            for key in keys:
                expert = EXPERT_KEY.search(key)
                assert (int(expert.group(1)) in range(lo, hi)) if expert else rank == 0, (rank, key)
            written |= set(keys)
        assert largest <= one_matrix < whole_expert
    assert written == set(index)
