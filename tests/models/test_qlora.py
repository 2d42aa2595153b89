"""QLoRA (`lora.quantize=nf4`, quantize.py): an NF4 model computes what the same model computes with its
dequantised weights put back as plain tensors, on every path that reads weights (full forward, capture + replay,
scoring, native rollout, the reference with adapters off); its adapter gradients are the dequantised model's; it
is built and loaded one decoder layer at a time; `longstraw plan` counts its bytes as torchao stores them.

The "dequantised model" is an independent build (the plain path, `build_model` without quantize) with the NF4
model's weights dequantised into it through `load_state_dict`."""

import pytest
import torch

pytest.importorskip("torchao")

from conftest import ids, rel_err
from longstraw_cli import quantize
from longstraw_cli.lora import LoraConfig, adapters_disabled, apply_lora, lora_layers, lora_state_dict
from longstraw_cli.models import build_model, from_pretrained
from longstraw_cli.quantize import dense, is_nf4, quantized_linears, storage_bytes
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate

FAMILIES = ("qwen36_tiny", "glm52_tiny")
# within the dtype's noise: the NF4 linear dequantises to the activations' dtype, the plain one reads that tensor
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def dequantised(model: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The plain build of `name` holding `model`'s weights, NF4 ones dequantised (and its adapters, if any)."""
    plain = build_model(name, dtype=dtype)
    if lora_layers(model):
        rank = next(iter(lora_layers(model).values())).rank
        apply_lora(plain, LoraConfig(rank=rank, alpha=4.0))
    plain.load_state_dict({k: dense(v) for k, v in model.state_dict().items()})
    assert quantized_linears(plain) == 0
    return plain


def nf4_model(name: str, dtype: torch.dtype, rank: int = 0) -> torch.nn.Module:
    model = build_model(name, dtype=dtype, seed=3, quantize="nf4")
    if rank:
        apply_lora(model, LoraConfig(rank=rank, alpha=4.0, quantize="nf4"))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            # B random: fresh adapters (B = 0) would leave the adapter path out of every comparison
            for layer in lora_layers(model).values():
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_every_base_linear_of_the_layers_is_nf4_and_nothing_else(name):
    model = nf4_model(name, torch.float32)
    nf4 = {n for n, p in model.named_parameters() if is_nf4(p)}
    assert nf4 and all(n.startswith("model.layers.") and n.endswith(".weight") for n in nf4)
    # never embeddings, lm_head, norms, the router, the experts or the DSA indexer
    assert not any(k in n for n in nf4 for k in ("norm", "embed", "lm_head", ".gate.weight", "mlp.experts.", "indexer"))
    linears = {f"{n}.weight" for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.") and ".indexer." not in n}
    assert nf4 == linears
    # 4-bit codes plus scalers: well under a third of fp32's bytes for those weights
    params = dict(model.named_parameters())
    assert sum(storage_bytes(params[n]) for n in nf4) < sum(params[n].numel() * 4 for n in nf4) / 6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_nf4_paths_equal_the_dequantised_model(name, dtype):
    """Full forward, capture + log-probs (scoring), native rollout and the reference (adapters off)."""
    model = nf4_model(name, dtype, rank=2)
    plain = dequantised(model, name, dtype)
    tol = TOLERANCE[dtype]
    x = ids(70, seed=1)
    assert rel_err(model(x).float(), plain(x).float()) <= tol

    prompt, response = ids(61, seed=2), ids(9, seed=3)
    with torch.no_grad():
        got = model.logprobs(model.capture(prompt, block_size=16), response)
        want = plain.logprobs(plain.capture(prompt, block_size=16), response)
    assert rel_err(got, want) <= tol
    with adapters_disabled(model), adapters_disabled(plain), torch.no_grad():
        base = model(x).float()
        assert rel_err(base, plain(x).float()) <= tol
    # the adapters are part of what the comparisons above saw
    assert rel_err(base, model(x).float()) > 10 * tol

    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0)
    rollouts = [generate(m, m.capture(prompt, block_size=16), 3, sampling, torch.Generator().manual_seed(0),
                         NativeConfig(cuda_graph=False)) for m in (model, plain)]
    if dtype != torch.bfloat16:
        # same logits, same generator: the same tokens
        assert [r.tolist() for r in rollouts[0].responses] == [r.tolist() for r in rollouts[1].responses]
        assert rel_err(torch.cat(rollouts[0].logprobs), torch.cat(rollouts[1].logprobs)) <= tol


@pytest.mark.parametrize("name", FAMILIES)
def test_adapter_gradients_equal_the_dequantised_model(name):
    from conftest import response_only_grads

    model = nf4_model(name, torch.float32, rank=2)
    plain = dequantised(model, name, torch.float32)
    prompt, responses = ids(57, seed=4), [ids(7, seed=5), ids(5, seed=6)]
    weights = [torch.linspace(-1, 1, 7), torch.linspace(0.5, 1, 5)]
    got = response_only_grads(model, prompt, responses, weights, block_size=20)
    want = response_only_grads(plain, prompt, responses, weights, block_size=20)
    assert set(got) == set(want) == set(lora_state_dict(model))
    worst = max(rel_err(got[k], want[k]) for k in want)
    print(f"{name}: adapter gradients, NF4 vs dequantised, max rel {worst:.1e}")
    assert worst <= 1e-5


def test_quantisation_loses_what_nf4_loses_and_no_more():
    """Against the weights before quantisation: the NF4 error of normal weights (~10% RMS at 4 bits)."""
    model = build_model("qwen36_tiny", seed=3, quantize="nf4")
    w = model.model.layers[0].mlp.up_proj.weight
    original = torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 0.02
    q = quantize.torchao_nf4().to_nf4(original, 64, quantize.scaler_block_size(original.numel()))
    assert 0.02 < rel_err(dense(q), original) < 0.15


@pytest.mark.parametrize("name", FAMILIES)
def test_built_and_loaded_one_layer_at_a_time(name, tmp_path, monkeypatch):
    """When layer i is quantised, layers > i are not yet allocated and layers < i hold NF4 weights only."""
    from longstraw_cli import models

    seen = []

    def spy(part):
        model = spy.model
        layers = list(model.model.layers)
        i = next(j for j, layer in enumerate(layers) if layer is part)
        later = [p.is_meta for layer in layers[i + 1:] for p in layer.parameters()]
        earlier_dense = [n for layer in layers[:i] for n, m in layer.named_modules()
                         if isinstance(m, torch.nn.Linear) and ".indexer" not in f".{n}" and not is_nf4(m.weight)]
        seen.append((i, all(later), earlier_dense))
        return real(part)

    real = quantize.quantize_linears
    monkeypatch.setattr(models, "quantize_linears", spy)
    original_on_meta = models._on_meta

    def on_meta(*args):
        spy.model = original_on_meta(*args)
        return spy.model

    monkeypatch.setattr(models, "_on_meta", on_meta)
    built = build_model(name, seed=0, quantize="nf4")
    num_layers = len(built.model.layers)
    assert seen == [(i, True, []) for i in range(num_layers)]

    if name.startswith("glm52"):
        return  # glm52 cannot be exported (refused); its loader path is the same code
    from longstraw_cli.lora import export_hf

    plain = build_model(name, seed=0)
    export_hf(plain, tmp_path / "hf")
    seen.clear()
    loaded = from_pretrained(tmp_path / "hf", quantize="nf4")
    assert seen == [(i, True, []) for i in range(num_layers)]
    # the loaded model is the plain one's weights, each base linear quantised, the rest as saved
    nf4 = quantize.torchao_nf4()
    want = plain.state_dict()
    for key, got in loaded.state_dict().items():
        if is_nf4(got):
            w = want[key]
            assert torch.equal(dense(got), dense(nf4.to_nf4(w, 64, quantize.scaler_block_size(w.numel())))), key
        else:
            assert torch.equal(got, want[key]), key


def test_export_writes_dequantised_merged_weights(tmp_path):
    from longstraw_cli.lora import export_hf

    model = nf4_model("qwen36_tiny", torch.float32, rank=2)
    export_hf(model, tmp_path / "hf")
    reloaded = from_pretrained(tmp_path / "hf")
    assert quantized_linears(reloaded) == 0
    x = ids(33, seed=10)
    with torch.no_grad():
        assert rel_err(reloaded(x), model(x)) <= 1e-5


@pytest.mark.parametrize("bad, expected", [
    (dict(rank=0, quantize="nf4"), "needs lora.rank > 0, got lora.rank=0"),
    (dict(rank=4, quantize="int4"), "lora.quantize='int4'; valid: ['none', 'nf4']"),
])
def test_bad_lora_config_is_one_line(bad, expected):
    with pytest.raises(ValueError) as e:
        LoraConfig(**bad)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, overrides, dtype", [
    ("qwen36_tiny", {}, "float32"),
    # qwen36_mini's widths (every linear 256 scalers a factor, as on the 27B shape), a GDN and a full-attention
    # layer, a small vocab
    pytest.param("qwen36_mini", {"num_hidden_layers": 2, "full_attention_interval": 2, "vocab_size": 1024},
                 "bfloat16", marks=pytest.mark.slow),
], ids=["tiny", "mini_widths"])
def test_plan_counts_the_bytes_torchao_stores(name, overrides, dtype):
    """plan's weights for quantize=nf4 equal the measured storage of every parameter, NF4 inner tensors
    included, adapters too."""
    from longstraw_cli.models.qwen36.config import named_config
    from longstraw_cli.plan import plan

    model = build_model(name, dtype=getattr(torch, dtype), seed=0, quantize="nf4", **overrides)
    apply_lora(model, LoraConfig(rank=16, quantize="nf4"))
    measured = sum(storage_bytes(p) for p in model.parameters())
    cfg = named_config(name, **overrides)
    common = dict(prompt_tokens=1024, group_size=2, response_tokens=16, dtype=dtype, lora_rank=16)
    planned = plan(cfg, quantize="nf4", **common)
    assert planned["weights"] == measured
    assert planned["weights"] < plan(cfg, **common)["weights"]


def test_nf4_cache_is_on_by_default_for_qlora_only():
    """rollout.native.nf4_cache=auto (the default) caches with lora.quantize=nf4 and only then; true and false
    override it (true without nf4 is refused by the config: tests/e2e/test_cli.py)."""
    assert NativeConfig().caches_nf4("nf4") and not NativeConfig().caches_nf4("none")
    assert not NativeConfig(nf4_cache=False).caches_nf4("nf4")
    assert NativeConfig(nf4_cache=True).caches_nf4("nf4")
    with pytest.raises(ValueError, match="true, false or auto, got 'on'"):
        NativeConfig(nf4_cache="on")


@pytest.mark.parametrize("name", FAMILIES)
def test_dense_copies_decode_the_same_and_put_the_nf4_weights_back(name):
    """rollout.native.nf4_cache's copies: a rollout with some or all NF4 linears held dequantised samples the
    same tokens with the same log-probs (the products multiply by the same values), and the NF4 Parameters are
    back afterwards."""
    model = nf4_model(name, torch.float32, rank=2)
    originals = {n: p for n, p in model.named_parameters() if is_nf4(p)}
    prompt = ids(61, seed=2)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0)

    def rollout():
        return generate(model, model.capture(prompt, block_size=16), 3, sampling, torch.Generator().manual_seed(0),
                        NativeConfig(cuda_graph=False))

    want = rollout()
    total = len(quantize.nf4_modules(model))
    assert total == len(originals)
    for count in (5, total):
        with quantize.dense_copies(model, count) as held:
            assert held == count and quantized_linears(model) == total - count
            got = rollout()
        assert [r.tolist() for r in got.responses] == [r.tolist() for r in want.responses]
        assert all(torch.equal(a, b) for a, b in zip(got.logprobs, want.logprobs))
        assert {n: p for n, p in model.named_parameters() if is_nf4(p)} == originals


def test_dense_cache_keeps_its_first_size_and_only_shrinks():
    model = nf4_model("qwen36_tiny", torch.float32)
    sizes = [m.weight.numel() * 4 for m in quantize.nf4_modules(model)]
    cache = quantize.DenseCache()
    assert cache.size(model, sum(sizes[:3]) + 1) == (3, sum(sizes[:3]), True)
    # more room later: the same count (the compiled decode step keeps its weights)
    assert cache.size(model, 10 * sum(sizes)) == (3, sum(sizes[:3]), False)
    assert cache.size(model, sum(sizes[:1])) == (1, sizes[0], True)
    assert cache.size(model, -5) == (0, 0, True)
    with quantize.dense_copies(model, 0) as held:
        assert held == 0 and quantized_linears(model) == len(sizes)
