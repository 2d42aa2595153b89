"""Each EP rank builds and loads only its share of glm52 (issue 33 items 1, 2 and 8), checked rank by rank in one
process (the build and the loader involve no collective; tests/distributed/test_ep_build.py runs them on gloo
ranks): a reduced-width glm52 with 64 routed experts, split over ep=8.

- per-rank parameter bytes after build and after load equal the rank's share: every replicated tensor plus
  E / ep of each routed expert tensor, counted on the whole shape built on the meta device;
- a rank's loader opens only the files that model.safetensors.index.json names for its keys and reads exactly
  its keys (counted by a wrapper around safe_open), from an HF checkpoint written by transformers'
  GlmMoeDsaForCausalLM (per-expert keys), re-split in GLM-5's key order over 18 files, plus an MTP layer in a
  file of its own;
- an FP8 block-quantised copy (float8_e4m3fn weights, weight_scale_inv per block) loads equal to a checkpoint of
  its dequantised weights (dequantised here block by block, by a loop);
- the peak of live tensor bytes during build and load (every storage any torch op or the checkpoint reader
  allocates, until it is freed) stays <= 1.1x the rank's share plus one of its decoder layers.
"""

import json
import re
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from longstraw_cli.distributed.ep import expert_bounds, is_expert_param
from longstraw_cli.models import build_model, from_pretrained, hf_model_config, loading
from longstraw_cli.models.loading import dequantize_fp8

transformers = pytest.importorskip("transformers")

EP, E = 8, 64
# glm52_tiny's layout, 64 experts: a dense first layer, three MoE layers
HF_CONFIG = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E, num_experts_per_tok=4, n_group=2,
    topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=24,
    index_topk=16, index_head_dim=32, index_n_heads=8, first_k_dense_replace=1,
    indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=4096,
)
MTP_FILE = "mtp.safetensors"
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def rank_slice(rank):
    return lambda num_experts: expert_bounds(num_experts, EP, rank)


def nbytes(model) -> int:
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return sum(t.numel() * t.element_size() for t in tensors.values())


def share(model_whole_meta) -> int:
    """The rank's share of a model: the replicated tensors whole, the routed experts' tensors 1/EP."""
    tensors = dict(model_whole_meta.named_parameters())
    tensors.update(model_whole_meta.named_buffers())
    return sum(t.numel() * t.element_size() // (EP if is_expert_param(n) else 1) for n, t in tensors.items())


def largest_layer(model) -> int:
    return max(nbytes(layer) for layer in model.model.layers)


def own_key(key: str, rank: int, num_layers: int) -> bool:
    """Whether a checkpoint key is this rank's: not past the model's layers (MTP), and if an expert's, its own."""
    layer = _LAYER_KEY.match(key)
    if layer is not None and int(layer.group(1)) >= num_layers:
        return False
    expert = _EXPERT_KEY.match(key)
    lo, hi = expert_bounds(E, EP, rank)
    return expert is None or lo <= int(expert.group(2)) < hi


class LiveBytes(TorchDispatchMode):
    """Bytes of every storage allocated by a torch op (or registered with `track`) and not yet freed; `peak` the
    most at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = (storage.data_ptr(), storage.nbytes()), storage.nbytes()
        if t.is_meta or size == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key, size):
        self.seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


class CountingOpen:
    """Stands in for loading.safe_open: records the files opened and the keys read; hands every tensor it reads
    to a LiveBytes, if given."""

    def __init__(self, live=None):
        self.files, self.keys, self.live = set(), [], live

    def __call__(self, filename, framework):
        self.files.add(filename.rsplit("/", 1)[-1])
        handle, outer = loading_safe_open(filename, framework=framework), self

        class Handle:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_tensor(self, key):
                outer.keys.append(key)
                tensor = handle.get_tensor(key)
                if outer.live is not None:
                    outer.live.track(tensor)
                return tensor

        handle.__enter__()
        return Handle()


loading_safe_open = loading.safe_open


def randomize_(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)


def key_order(key: str):
    """Keys by layer, then expert id, as GLM-5's own files hold them (transformers 5 writes a projection of every
    expert together instead)."""
    layer, expert = _LAYER_KEY.match(key), _EXPERT_KEY.match(key)
    return (int(layer.group(1)) if layer else -1, int(expert.group(2)) if expert else -1, key)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, one_thread):
    """transformers' checkpoint of random weights, its keys re-split in GLM-5's order over files of 40 tensors
    (a file holds ~13 experts: a rank's 8 experts of a layer lie in one or two of a layer's five), with an
    index.json; plus an MTP layer (layer 4) in a file of its own that the index names."""
    torch.manual_seed(0)
    hf = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**HF_CONFIG)).eval()
    randomize_(hf)
    path = tmp_path_factory.mktemp("glm52_sharded")
    hf.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    keys, weight_map = sorted(tensors, key=key_order), {}
    chunks = [keys[i:i + 40] for i in range(0, len(keys), 40)]
    for i, chunk in enumerate(chunks):
        file = f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({k: tensors[k] for k in chunk}, path / file)
        weight_map.update(dict.fromkeys(chunk, file))
    mtp = {k.replace("model.layers.0.", f"model.layers.{HF_CONFIG['num_hidden_layers']}."): v.clone()
           for k, v in tensors.items() if k.startswith("model.layers.0.")}
    save_file(mtp, path / MTP_FILE)
    weight_map.update(dict.fromkeys(mtp, MTP_FILE))
    (path / loading.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def test_checkpoint_is_split_and_per_expert(hf_dir):
    files = set(json.loads((hf_dir / loading.INDEX).read_text())["weight_map"].values())
    assert len(files) >= 10 and MTP_FILE in files
    assert "model.layers.1.mlp.experts.63.down_proj.weight" in loading.weight_map(hf_dir)


def test_build_bytes_are_the_share_and_ranks_agree_with_one():
    live_whole = LiveBytes()
    with live_whole:
        whole = build_model("glm52_tiny", seed=5, n_routed_experts=E)
    expected = share(build_model("glm52_tiny", device="meta", n_routed_experts=E))
    state = whole.state_dict()
    for rank in range(EP):
        live = LiveBytes()
        with live:
            ours = build_model("glm52_tiny", seed=5, n_routed_experts=E, expert_slice=rank_slice(rank))
        assert nbytes(ours) == expected
        bound = 1.1 * expected + largest_layer(ours)
        print(f"build rank {rank}: peak {live.peak} B, share {expected} B, bound {bound:.0f} B")
        # the count sees the model's own tensors, and a whole build would not fit the bound
        assert expected <= live.peak <= bound < live_whole.peak
        lo, hi = expert_bounds(E, EP, rank)
        for name, t in ours.state_dict().items():
            assert torch.equal(t, state[name][lo:hi] if is_expert_param(name) else state[name]), name
    assert nbytes(whole) > 4 * expected


def test_rank_opens_its_files_and_reads_its_keys(hf_dir, monkeypatch):
    weight_map = loading.weight_map(hf_dir)
    whole = from_pretrained(hf_dir)
    spec, cfg = hf_model_config(hf_dir)
    with torch.device("meta"):
        expected = share(spec.model_cls(cfg))
    state, read_by_rank = whole.state_dict(), []
    for rank in range(EP):
        live = LiveBytes()
        opener = CountingOpen(live)
        monkeypatch.setattr(loading, "safe_open", opener)
        with live:
            ours = from_pretrained(hf_dir, expert_slice=rank_slice(rank))
        want = sorted(k for k in weight_map if own_key(k, rank, HF_CONFIG["num_hidden_layers"]))
        assert sorted(opener.keys) == want
        assert opener.files == {weight_map[k] for k in want} and MTP_FILE not in opener.files
        assert len(opener.files) < len(set(weight_map.values())) - 1
        read_by_rank.append(opener.keys)
        assert nbytes(ours) == expected
        bound = 1.1 * expected + largest_layer(ours)
        print(f"load rank {rank}: {len(opener.files)} of {len(set(weight_map.values()))} files, {len(opener.keys)} "
              f"of {len(weight_map)} tensors; peak {live.peak} B, share {expected} B, bound {bound:.0f} B")
        assert expected <= live.peak <= bound
        lo, hi = expert_bounds(E, EP, rank)
        for name, t in ours.state_dict().items():
            assert torch.equal(t, state[name][lo:hi] if is_expert_param(name) else state[name]), name
    # every routed-expert key of the model's layers read by exactly one rank
    experts = sorted(k for keys in read_by_rank for k in keys if _EXPERT_KEY.match(k))
    assert experts == sorted(k for k in weight_map if _EXPERT_KEY.match(k)
                             and int(_LAYER_KEY.match(k).group(1)) < HF_CONFIG["num_hidden_layers"])


def quantize_fp8(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight and fp32 scale_inv per block, as DeepSeek-V3 / GLM-5-FP8 store them."""
    R, C = w.shape
    b0, b1 = block
    q, scale = torch.empty(R, C, dtype=torch.float8_e4m3fn), torch.empty(-(-R // b0), -(-C // b1))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
            scale[i, j] = blk.abs().max().clamp_min(1e-12) / 448.0
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_by_loop(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    out = torch.empty(q.shape)
    b0, b1 = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def fp8_copies(src, fp8_dir, ref_dir, block):
    """An FP8 copy of every projection weight of src (same files; layer 0's scales in a file of their own, the
    others beside their weights) and a checkpoint of the same weights dequantised by a loop."""
    index = json.loads((src / loading.INDEX).read_text())
    weight_map, scale_file = dict(index["weight_map"]), "scales.safetensors"
    fp8_files, ref_files, scales_apart = {}, {}, {}
    for file in sorted(set(weight_map.values())):
        tensors = load_file(src / file)
        fp8, ref = {}, {}
        for key, t in tensors.items():
            projection = key.endswith(("_proj.weight", "wq_b.weight", "wk.weight")) and "weights_proj" not in key
            if t.dim() == 2 and projection:
                q, s = quantize_fp8(t, block)
                fp8[key], ref[key] = q, dequantize_by_loop(q, s, block)
                if key.startswith("model.layers.0."):
                    scales_apart[key + "_scale_inv"] = s
                    weight_map[key + "_scale_inv"] = scale_file
                else:
                    fp8[key + "_scale_inv"] = s
                    weight_map[key + "_scale_inv"] = file
            else:
                fp8[key], ref[key] = t, t
        fp8_files[file], ref_files[file] = fp8, ref
    fp8_files[scale_file] = scales_apart
    hf_config = json.loads((src / "config.json").read_text())
    for out, files, quant in ((fp8_dir, fp8_files, True), (ref_dir, ref_files, False)):
        out.mkdir()
        for file, tensors in files.items():
            save_file(tensors, out / file)
        config = dict(hf_config, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                      "weight_block_size": list(block)}) if quant else hf_config
        (out / "config.json").write_text(json.dumps(config))
        kept = weight_map if quant else {k: v for k, v in weight_map.items() if not k.endswith("_scale_inv")}
        (out / loading.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": kept}))


@pytest.mark.parametrize("block", [(128, 128), (32, 16)])
def test_fp8_checkpoint_loads_as_its_dequantised_weights(hf_dir, tmp_path, monkeypatch, block):
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    fp8_copies(hf_dir, fp8_dir, ref_dir, block)
    # real FP8 weights: float8_e4m3fn in the files (q_b_proj [192, 48] spans two 128-row blocks, the second partial)
    stored = load_file(fp8_dir / loading.weight_map(fp8_dir)["model.layers.1.self_attn.q_b_proj.weight"])
    assert stored["model.layers.1.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    for dtype in (torch.float32, torch.bfloat16):
        for rank in (0, EP - 1):
            opener = CountingOpen()
            monkeypatch.setattr(loading, "safe_open", opener)
            got = from_pretrained(fp8_dir, dtype=dtype, expert_slice=rank_slice(rank))
            monkeypatch.undo()
            want = from_pretrained(ref_dir, dtype=dtype, expert_slice=rank_slice(rank))
            for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
                assert a.dtype == b.dtype and torch.equal(a, b), name
            lo, hi = expert_bounds(E, EP, rank)
            scales = {k for k in opener.keys if k.endswith("_scale_inv")}
            assert scales and all(lo <= int(_EXPERT_KEY.match(k).group(2)) < hi for k in scales if _EXPERT_KEY.match(k))
    assert "scales.safetensors" in opener.files


def test_dequantize_fp8_matches_the_block_loop_and_rejects_bad_scales():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=g)
    for block in ((128, 128), (64, 32), (300, 200)):
        q, s = quantize_fp8(w, block)
        assert torch.equal(dequantize_fp8(q, s, block), dequantize_by_loop(q, s, block))
        err = (dequantize_fp8(q, s, block) - w).norm() / w.norm()
        assert 0 < err < 0.05
    with pytest.raises(ValueError, match=r"expected \(3, 2\)"):
        dequantize_fp8(q, torch.ones(2, 2), (128, 128))


def test_bad_quant_method_and_missing_scale(hf_dir, tmp_path):
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    fp8_copies(hf_dir, fp8_dir, ref_dir, (128, 128))
    config = json.loads((fp8_dir / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps(dict(config, quantization_config={"quant_method": "awq"})))
    with pytest.raises(ValueError, match=r"quant_method='awq'; valid: \['fp8'\]"):
        from_pretrained(fp8_dir)
    (fp8_dir / "config.json").write_text(json.dumps(config))
    index = json.loads((fp8_dir / loading.INDEX).read_text())
    del index["weight_map"]["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    (fp8_dir / loading.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="o_proj.weight is torch.float8_e4m3fn but the checkpoint has no"):
        from_pretrained(fp8_dir)
