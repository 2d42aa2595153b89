"""Expert-parallel ranks build and load only their own routed experts, as the trainer does (`ep_slice` of the EP
group into build_model / from_pretrained, then apply_expert_parallel keeps the slice), on 8 gloo ranks (CPU):
each rank's parameter bytes are its share, and the sharded model's logits equal the one-rank model's, built from
the same seed (named config) or loaded from the same HF directory. A model holding another rank's slice is
refused before any collective.
"""

import os

import pytest
import torch
import torch.distributed as dist

from conftest import join_gloo, rel_err, run_ranks
from longstraw_cli.distributed.ep import apply_expert_parallel, ep_slice, expert_bounds, is_expert_param
from longstraw_cli.models import build_model, from_pretrained

transformers = pytest.importorskip("transformers")

WORLD, E = 8, 64
HF_CONFIG = dict(
    vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=E, num_experts_per_tok=4, n_group=2,
    topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    index_topk=8, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1,
    indexer_types=["full", "shared", "full"], max_position_embeddings=4096,
)
IDS = torch.randint(0, 259, (1, 24), generator=torch.Generator().manual_seed(1))


def named(**kwargs):
    return build_model("glm52_tiny", dtype=torch.float64, seed=7, n_routed_experts=E, **kwargs)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _worker(rank, world_size, port, out_dir, hf_dir):
    join_gloo(rank, world_size, port)
    group, out = dist.group.WORLD, {}
    for source, make in (("named", named),
                         ("hf", lambda **kw: from_pretrained(hf_dir, dtype=torch.float64, **kw))):
        model = make(expert_slice=ep_slice(group))
        apply_expert_parallel(model, group, cp_group=group)
        out[source] = {"bytes": param_bytes(model), "rows": model.model.layers[1].mlp.experts.expert_rows}
        with torch.no_grad():
            out[source]["logits"] = model(IDS)
    wrong = named(expert_slice=lambda n: expert_bounds(n, world_size, (rank + 1) % world_size))
    try:
        apply_expert_parallel(wrong, group, cp_group=group)
    except ValueError as e:
        out["wrong_slice"] = str(e)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**HF_CONFIG)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("glm52_ep_hf")
    hf.save_pretrained(path)
    return path


@pytest.mark.distributed
def test_ranks_build_and_load_their_share_and_compute_as_one(tmp_path, hf_dir, one_thread):
    run_ranks(_worker, WORLD, str(tmp_path), str(hf_dir), timeout_s=300)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for source, whole in (("named", named()), ("hf", from_pretrained(hf_dir, dtype=torch.float64))):
        with torch.no_grad():
            want = whole(IDS)
        shares = [sum(p.numel() * p.element_size() // (WORLD if is_expert_param(n) else 1)
                      for n, p in whole.named_parameters())]
        for rank, got in enumerate(results):
            assert got[source]["bytes"] == shares[0]
            assert got[source]["rows"] == expert_bounds(E, WORLD, rank)
            assert rel_err(got[source]["logits"], want) < 1e-12, (source, rank)
        assert param_bytes(whole) > 3 * shares[0]
    assert all("build it with ep_slice(group)" in got["wrong_slice"] for got in results)
